"""The model: config, layers (dense and quantised linears), rotary embedding, paged attention, KV
cache, the runner that builds one flat batch per step, CUDA graphs and the sampler."""
