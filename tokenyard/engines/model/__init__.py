"""The model: config, layers, rotary embedding, paged attention, KV cache, the runner that builds
one flat batch per step, CUDA graphs and the sampler."""
