"""Weight-only int8/int4 quantisation: quantised linears, checkpoints, GGUF blocks kept as stored."""
