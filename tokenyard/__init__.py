"""Tokenyard: an LLM serving gateway with built-in PyTorch engines.

Sub-packages: tokenyard.gateway (HTTP), tokenyard.engines (PyTorch engines), tokenyard.kernels,
tokenyard.policies, tokenyard.router_models, tokenyard.cli, tokenyard.bench, tokenyard.demo,
tokenyard.nativelib. Importing this package imports none of them (the GPU box imports
tokenyard.engines from PYTHONPATH alone).

Package data, so an installed wheel serves without a checkout: deploy/default.yaml (what `tokenyard serve`
runs without --config), the demo pair it names under models/, the router artifacts and the example policy.
"""
from __future__ import annotations

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    # Read lazily: importlib.metadata costs start-up time every engine process would pay otherwise.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version
        try:
            value = version("tokenyard")
        except PackageNotFoundError:   # a checkout on PYTHONPATH, not installed (the GPU box)
            value = "0+unknown"
        globals()["__version__"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
