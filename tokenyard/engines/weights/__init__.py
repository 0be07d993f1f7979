"""Loading weights: safetensors folders, GGUF files (dequantised), packaged GGUFs, and the one
dispatcher the engine calls."""
