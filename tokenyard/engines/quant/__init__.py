"""Weight-only int8/int4 quantisation: quantising a model, quantised checkpoints, GGUF blocks kept as
stored, tensor-parallel shards of quantised weights, and the engine's load dispatcher (engine_model)
that picks between the plain loaders below (weights/) and the quantised ones here. The quantised
linear layer itself is part of the model (tokenyard.engines.model.quantized_linear)."""
