"""On-disk formats parsed without a model: GGUF (metadata, tensors, tokenizer vocabulary), read by
the model config, the weight loaders and the tokenizer alike, so it sits below all of them."""
