"""LoRA adapters served beside their base model: PEFT's format, a fixed pool, batched products."""
