"""Speculative decoding: prompt-lookup and draft-model proposers, verification and acceptance."""
