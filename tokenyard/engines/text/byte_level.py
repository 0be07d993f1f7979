"""The GPT-2 byte-level alphabet and the Llama-3 pre-tokenizer split: shared by the tokenizer built
from a folder (tokenizer.py) and the one built from GGUF metadata (gguf_tokenizer.py)."""
from __future__ import annotations

# Llama-3's pre-tokenizer split (the cl100k shape with digit runs of at most three).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level alphabet, printable character -> byte (the inverse of what BPE vocabularies store)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:  # control bytes and spaces move to 256+ so that every byte is visible
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {ch: b for b, ch in chars.items()}
