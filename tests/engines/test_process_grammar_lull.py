"""An engine core in a process of its own never warms its grammar set on its own (the first compile
builds it), and its parent (given `idle`) starts the grammar worker only in the engine's first lull,
in the idle scheduling class (tokenyard/engines/serving/process_grammars.py): work beside the first
requests after ready made a SmolLM2 replica's first request 2-7x the rest."""
from __future__ import annotations

import asyncio
import time

from gateway_helpers import ROOT

from tokenyard.engines import Engine
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.serving.process_grammars import ChildCompiler, ProcessGrammars


class _Engine:
    """What ChildCompiler uses of an engine: has_unfinished, warm_grammars, prepare_grammar."""

    def __init__(self) -> None:
        self.busy = True
        self.calls: list[str] = []

    def has_unfinished(self) -> bool:
        return self.busy

    def warm_grammars(self) -> None:
        self.calls.append("warm")

    def prepare_grammar(self, fmt: dict) -> None:
        self.calls.append(f"compile {fmt['type']}")


def _wait(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_the_child_never_warms_on_its_own_even_when_idle() -> None:
    engine, sent = _Engine(), []
    engine.busy = False
    compiler = ChildCompiler(engine, sent.append)
    try:
        time.sleep(0.5)
        assert engine.calls == [] and sent == []
    finally:
        compiler.close()


def test_a_compile_is_answered_in_order() -> None:
    engine, sent = _Engine(), []
    compiler = ChildCompiler(engine, sent.append)
    try:
        compiler.submit(7, {"type": "json_object"})
        compiler.submit(8, {"type": "json_schema"})
        assert _wait(lambda: len(sent) == 2)
        assert engine.calls == ["compile json_object", "compile json_schema"]
        assert sent == [("grammar", 7, None), ("grammar", 8, None)]
    finally:
        compiler.close()


class _Worker:
    name = "fake"

    def __init__(self) -> None:
        self.starts = 0
        self.closed = False

    async def start(self) -> None:
        self.starts += 1

    def close(self) -> None:
        self.closed = True


def test_the_parent_given_idle_starts_its_worker_in_the_first_lull() -> None:
    async def main() -> None:
        busy = {"in_flight": 1}
        worker = _Worker()
        grammars = ProcessGrammars(worker, idle=lambda: busy["in_flight"] == 0, idle_s=0.2)  # type: ignore[arg-type]
        await grammars.start()
        await grammars.start()                     # a second start schedules nothing more
        await asyncio.sleep(0.5)
        assert worker.starts == 0, "the worker started while a request was in flight"
        busy["in_flight"] = 0
        for _ in range(100):
            if worker.starts:
                break
            await asyncio.sleep(0.02)
        assert worker.starts == 1
        grammars.close()
        assert worker.closed
        waiting = ProcessGrammars(_Worker(), idle=lambda: True, idle_s=0.2)  # type: ignore[arg-type]
        await waiting.start()
        waiting.close()                            # cancels the wait: no worker after close
        await asyncio.sleep(0.4)
        assert waiting.worker.starts == 0

    asyncio.run(main())


def test_the_parent_without_idle_starts_its_worker_at_once() -> None:
    async def main() -> None:
        worker = _Worker()
        grammars = ProcessGrammars(worker)  # type: ignore[arg-type]
        await grammars.start()
        assert worker.starts == 1
        grammars.close()

    asyncio.run(main())


def test_a_real_engine_builds_its_grammar_set_at_the_first_compile_only() -> None:
    """The demo engine, stepped on this thread the way the core's loop steps it, beside the compiler's
    thread: requests, then a rest, and no grammar set is built; the first json_object compile builds it
    and serves a constrained request."""
    engine = Engine(ROOT / "models" / "demo-small", dtype="float32", kv_cache_memory=8 << 20)
    sent: list[tuple] = []
    built: list[float] = []
    real_set = engine._grammar_set
    engine._grammar_set = lambda: (built.append(time.monotonic()), real_set())[1]  # type: ignore[method-assign]
    compiler = ChildCompiler(engine, sent.append)
    try:
        for n in range(3):
            engine.add_request(f"r{n}", [1, 2, 3, 4, 5, 6, 7, 8],
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
        time.sleep(0.5)                            # a lull: nothing is built in it
        assert not built, "the grammar set was built with no compile asked for"
        fmt = {"type": "json_object"}
        compiler.submit(1, fmt)
        assert _wait(lambda: sent == [("grammar", 1, None)], 60.0), sent
        assert built
        engine.add_request("json", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, response_format=fmt))
        while engine.has_unfinished():
            engine.step()
    finally:
        compiler.close()
