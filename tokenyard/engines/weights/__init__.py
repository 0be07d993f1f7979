"""Loading plain weights: safetensors folders, GGUF files (dequantised) and packaged GGUFs. The GGUF
reader is below (tokenyard.engines.formats); the dispatcher the engine calls is above (quant/engine_model)."""
