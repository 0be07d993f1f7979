"""Shared by the engine-process tests (tests/gateway/test_engine_process*.py): a mock engine's recipe and
draining one request's stream."""
from __future__ import annotations

import asyncio

from gateway_helpers import ROOT

from tokenyard.engines.serving.engine_process import EngineRecipe

MODEL = ROOT / "models" / "demo-small"


def recipe(**options) -> EngineRecipe:
    return EngineRecipe("mock", MODEL, options)


async def collect(stream, timeout: float = 10.0) -> list:
    """Every output of one request's stream, up to its finished one (TimeoutError past `timeout` per output)."""
    outs = []
    while True:
        out = await asyncio.wait_for(stream.get(), timeout)
        outs.append(out)
        if out.finished:
            return outs
