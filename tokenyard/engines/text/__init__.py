"""Text: tokenizers (tokenizer.json, tiktoken, GGUF metadata), chat templates, detokenising streams."""
