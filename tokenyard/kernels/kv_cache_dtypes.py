"""The names `kv_cache_dtype` takes (tokenyard/kernels/kv_quant.py stores them).

Apart from kv_quant so the engine config can check a deployment's value without importing torch
(a gateway or a replica's parent validates configs whose engines step elsewhere).
"""
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
