"""An engine stepped in a process of its own (the engine core), driven from the gateway's event loop.

    backend = EngineProcess(EngineRecipe("torch", model_dir, {"dtype": "float32"}), name="w2")  # blocks: loads
    await backend.start()
    stream = backend.add_request("r1", prompt_ids, params)     # the interface of AsyncEngine
    async for out in stream: ...
    backend.abort("r1"); await backend.stop()

Why a process: an in-process engine (tokenyard/engines/runtime/async_engine.py) steps on a thread beside the event
loop, and the two share Python's GIL. The step thread gives the GIL up inside every torch op and C
step and must win it back after each, while the event loop writes every stream's tokens; on two cores
the engine's pool threads wait for it too. Here the child process runs one loop and nothing else
(take the messages that arrived, step, send the step's outputs as one message), and the parent's
event loop only reads one message per step and sends one per new request or abort.

The link is a private socketpair carrying frames of a 4-byte big-endian length and a pickle; the
child's end is tokenyard/engines/serving/engine_child.py. Parent to child: ("add", request_id, prompt_ids,
params, priority, cache_salt), ("abort", request_id), ("grammar", token, response_format),
("sleep", level), ("wake",) and ("adapter", "load"|"unload", name, path).
Child to parent: ("ready", max_model_len, stats, grammar_info) once
the engine is built, ("out", outputs, stats) after each step, ("grammar", token, error or None) when
a grammar is compiled, ("slept", seconds, None or (kind, message)) and ("woke", phases) answering
sleep and wake, ("adapter", result, None or (kind, message), stats) answering an adapter message,
("failed", message, exception) when it gives up. The parent never blocks on the child: its writes are buffered
by asyncio, and the child reads them between steps (so a request waits at most one step to be
admitted, as with the in-process inbox).

Constrained requests: `await backend.prepare(params)` before add_request, as with AsyncEngine. The
schema is checked against its budget in a grammar worker of the parent's, then compiled on a thread
of the child, never on its step path (tokenyard/engines/serving/process_grammars.py).

Bad input: the child validates a request when it takes it, so a refusal (a bad grammar, a prompt too
long) arrives as the stream's first output, finished with finish_reason "error" and bad_request set;
the gateway answers it with a 400 as it does for a remote replica's refusal.

Failures: a step that raises, an engine that reports itself dead (a tensor-parallel worker died) or a
child that exits fails every request in flight with an "error" output at once, and the process is
started again from the same recipe; while that runs new requests raise EngineDeadError (503). A start
that fails is retried `max_restart_attempts` times with exponential backoff from `restart_backoff_s`
(capped at 30 s); after that the engine stays dead.

Sleep (tokenyard/engines/core/sleep_level.py): `await backend.sleep(level)` waits for the requests
in flight, then the child releases the memory; a request sent meanwhile is queued and the child's
next step wakes the engine; `await backend.wake()` wakes it at once. A wake that fails is a failed
process: its waiting requests end retryable (none got a token) and a fresh process starts.

Two engines in process mode step at the same time (in-process engines take turns on one thread,
tokenyard/engines/runtime/executor.py): give each its share of the cores (OMP_NUM_THREADS, the engine's threads).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.outputs import EngineStats, StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.core.sleep_level import (
    ASLEEP,
    AWAKE,
    WAKING,
    SleepBusy,
    SleepLevelError,
    SleepUnsupported,
    check_sleep_level,
)
from tokenyard.engines.runtime.async_engine import RequestStream, cancel_task, deliver, fail_streams, with_backoff
from tokenyard.engines.runtime.grammar_worker import GrammarBudget, GrammarWorker
from tokenyard.engines.serving.engine_child import _HEADER, _child_main, _frame, _Link
from tokenyard.engines.serving.process_grammars import ProcessGrammars

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[3]    # holds tokenyard/: the child imports it from here
_STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class EngineRecipe:
    """What an engine is built from, picklable so a fresh process can build it."""

    kind: str                                   # "torch" or "mock"
    model: Path                                 # checkpoint folder or .gguf file (mock: its tokenizer)
    options: dict[str, Any] = field(default_factory=dict)   # EngineConfig / MockConfig keys

    def build(self) -> Any:
        if self.kind == "mock":
            from tokenyard.engines.serving.mock_engine import MockEngine
            return MockEngine(self.model, **self.options)
        from tokenyard.engines.runtime.engine import Engine
        return Engine(self.model, **{"progress": False, **self.options})


class EngineProcess:
    """The EngineBackend (tokenyard/engines/core/backend.py) of an engine stepped in a child process."""

    def __init__(self, recipe: EngineRecipe, name: str = "engine", max_restart_attempts: int = 5,
                 restart_backoff_s: float = 0.5) -> None:
        self.recipe = recipe
        self.name = name
        self.dead: str | None = None
        self.num_failed_steps = 0         # steps that raised (and engines that reported themselves dead)
        self.num_restarts = 0             # processes started again after a failure
        self.num_failed_restarts = 0
        self._max_restart_attempts = max_restart_attempts
        self._restart_backoff_s = restart_backoff_s
        self._streams: dict[str, RequestStream] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._sleep_level = 0
        self._waking_since: float | None = None      # loop time a wake began (by call or by a request)
        self._control_reply: asyncio.Future | None = None   # the answer to the sleep or wake under way
        self._control_lock: asyncio.Lock | None = None
        self.last_wake_s: float | None = None
        self._proc, self._sock, self._max_model_len, self._stats, grammar = self._spawn()
        # The grammar worker is the parent's: it outlives the child's restarts, and so do its verdicts.
        self._grammars = None if grammar is None else ProcessGrammars(
            GrammarWorker(Path(grammar[0]), GrammarBudget(grammar[1], grammar[2]), name))

    # -- the backend interface ----------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def stats(self) -> EngineStats:
        """As the child sent it after its latest step."""
        return self._stats

    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-process-{self.name}")
            while self._writer is None and not self._task.done():
                await asyncio.sleep(0)
            if self._grammars is not None:
                await self._grammars.start()

    async def stop(self) -> None:
        """Abort everything in flight, hang up (the child exits) and wait for the process."""
        self._stopping = True
        for rid in list(self._streams):
            self.abort(rid)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        await cancel_task(self._task)
        self._task = None
        if self._grammars is not None:
            self._grammars.close()
        self._sock.close()              # the child sees the end of its input and exits
        await asyncio.get_running_loop().run_in_executor(None, self._reap, self._proc)

    async def prepare(self, params: SamplingParams) -> None:
        """Make the request's grammar ready off the event loop and off the child's step; GrammarError
        when it is refused. Call add_request right after (no await between)."""
        if self._grammars is not None and params.response_format is not None:
            await self._grammars.prepare(params.response_format, self._send_grammar)

    def _send_grammar(self, token: int, fmt: dict) -> bool:
        if self.dead is not None or self._writer is None:
            return False
        self._writer.write(_frame(("grammar", token, fmt)))
        return True

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue the request in the child; refusals come back as the stream's first output."""
        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name} is down: {self.dead}")
        if self._writer is None:
            raise EngineDeadError(f"engine {self.name} is not started")
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        if self._sleep_level and self._waking_since is None:   # the child's next step wakes the engine
            self._waking_since = asyncio.get_running_loop().time()
        self._writer.write(_frame(("add", request_id, list(prompt_token_ids), params, priority, cache_salt)))
        return stream

    def abort(self, request_id: str) -> None:
        """End the stream with an "abort" output now; the child frees the request's blocks at its next step."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(StepOutput(request_id, [], finished=True, finish_reason="abort"))
            if self._writer is not None:
                self._writer.write(_frame(("abort", request_id)))

    # -- sleep and wake -------------------------------------------------------------------------
    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    @property
    def sleep_state(self) -> str:
        if self._waking_since is not None:
            return WAKING
        return ASLEEP if self._sleep_level else AWAKE

    async def sleep(self, level: int, drain_timeout_s: float = 30.0) -> float:
        """As AsyncEngine.sleep: drain (SleepBusy past drain_timeout_s), then the child sleeps."""
        level = check_sleep_level(level)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while True:
            while self._streams or self._waking_since is not None:
                if loop.time() >= deadline:
                    raise SleepBusy(f"engine {self.name} still had {max(1, len(self._streams))} request(s) in "
                                    f"flight after {drain_timeout_s:g} s; it stays awake")
                await asyncio.sleep(0.02)
            seconds, err = await self._control(("sleep", level))
            if err is None:
                self._sleep_level = max(self._sleep_level, level)
                return seconds
            kind, message = err
            if kind == "level":
                raise SleepLevelError(message)
            if kind != "busy":
                raise SleepUnsupported(message)
            await asyncio.sleep(0.02)       # a request slipped in before the child took the message

    async def wake(self) -> dict[str, float]:
        """Wake the child's engine now; {phase: seconds}. EngineDeadError when the process failed."""
        if not self._sleep_level:
            return {}
        if self._waking_since is None:
            self._waking_since = asyncio.get_running_loop().time()
        (phases,) = await self._control(("wake",))
        if self._sleep_level:
            self._awake()
        return phases

    # -- LoRA adapters at run time (a run-time adapter is not in the recipe: a restarted process lacks it) --
    async def load_adapter(self, name: str, path: str) -> dict:
        return await self._adapter("load", name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._adapter("unload", name, None)

    async def _adapter(self, op: str, name: str, path: str | None) -> Any:
        from tokenyard.engines.lora.adapter_errors import error_of
        result, err, stats = await self._control(("adapter", op, name, path))
        if stats is not None:
            self._stats = stats
        if err is not None:
            raise error_of(*err)
        return result

    async def _control(self, msg: tuple) -> tuple:
        """Send a sleep or wake message and wait for its answer (one at a time)."""
        if self._control_lock is None:
            self._control_lock = asyncio.Lock()
        async with self._control_lock:
            if self.dead is not None or self._writer is None:
                raise EngineDeadError(f"engine {self.name} is down: {self.dead or 'not started'}")
            self._control_reply = asyncio.get_running_loop().create_future()
            self._writer.write(_frame(msg))
            try:
                return await self._control_reply
            finally:
                self._control_reply = None

    def _awake(self) -> None:
        if self._waking_since is not None:
            self.last_wake_s = asyncio.get_running_loop().time() - self._waking_since
        self._sleep_level, self._waking_since = 0, None

    # -- the process ----------------------------------------------------------------------------
    def _spawn(self) -> tuple[subprocess.Popen, socket.socket, int, EngineStats, Any]:
        """Start a child and wait until its engine is built (blocking: weights load there)."""
        ours, theirs = socket.socketpair()
        # A fresh interpreter, not fork (the parent has an event loop and torch's threads, which fork
        # would copy half-alive) and not multiprocessing's spawn (which imports the parent's __main__).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.Popen([sys.executable, "-m", "tokenyard.engines.serving.engine_process", "--fd",
                                     str(theirs.fileno()), "--name", self.name], pass_fds=(theirs.fileno(),), env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        link = _Link(ours)
        link.send(("recipe", self.recipe))
        msgs = link.receive(block=True)
        if not msgs or msgs[0][0] != "ready":
            ours.close()
            self._reap(proc)
            if msgs and msgs[0][0] == "failed":
                _, message, exc = msgs[0]
                if exc is not None:
                    raise exc
                raise EngineDeadError(f"engine {self.name}: {message}")
            raise EngineDeadError(f"engine {self.name}: its process exited while building the engine "
                                  f"(exit code {proc.returncode})")
        _, max_model_len, stats, grammar = msgs[0]
        if len(msgs) > 1 or link.buf:
            raise EngineDeadError(f"engine {self.name}: unexpected messages after ready")
        return proc, ours, max_model_len, stats, grammar

    @staticmethod
    def _reap(proc: subprocess.Popen) -> None:
        """Wait for a process told to exit (its socket closed); terminate, then kill, one that does not."""
        for stop in (None, proc.terminate, proc.kill):
            if stop is not None:
                stop()
            try:
                proc.wait(_STOP_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    async def _run(self) -> None:
        while True:
            reader, writer = await asyncio.open_unix_connection(sock=self._sock)
            self._writer = writer
            why = await self._pump(reader)
            if self._stopping:
                return
            self._writer = None
            writer.close()
            if self._grammars is not None:
                self._grammars.child_gone()
            streams, self._streams = self._streams, {}
            # Requests waiting for a wake got no token: a replica pool may run them elsewhere.
            fail_streams(streams, why, retryable=self._waking_since is not None)
            if self._control_reply is not None and not self._control_reply.done():
                self._control_reply.set_exception(EngineDeadError(f"engine {self.name}: {why}"))
            self._sleep_level, self._waking_since = 0, None      # a fresh process starts awake
            if not await self._restart(why):
                return

    async def _pump(self, reader: asyncio.StreamReader) -> str:
        """Deliver the child's outputs until it fails or exits; returns why it stopped."""
        try:
            while True:
                (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                msg = pickle.loads(await reader.readexactly(n))
                if msg[0] == "out":
                    deliver(self._streams, msg[1])
                    if msg[2] is not None:     # a step ran: a sleeping engine woke for it
                        self._stats = msg[2]
                        if self._sleep_level:
                            self._awake()
                elif msg[0] in ("slept", "woke", "adapter"):
                    if self._control_reply is not None and not self._control_reply.done():
                        self._control_reply.set_result(msg[1:])
                elif msg[0] == "grammar":
                    if self._grammars is not None:
                        self._grammars.resolve(msg[1], msg[2])
                elif msg[0] == "failed":
                    self.num_failed_steps += 1
                    return msg[1]
        except (pickle.UnpicklingError, ValueError, TypeError, IndexError, AttributeError) as e:
            return f"the engine process sent a message that could not be read: {type(e).__name__}: {e}"
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._proc.wait, 1.0)
            except subprocess.TimeoutExpired:
                pass
            return f"the engine process exited (exit code {self._proc.returncode}; {type(e).__name__})"

    async def _restart(self, why: str) -> bool:
        """Start a fresh process from the recipe; False when every attempt failed (the engine stays dead)."""
        loop = asyncio.get_running_loop()
        self.dead = f"restarting after: {why}"
        log.error("engine %s failed (%s); starting its process again", self.name, why)
        await loop.run_in_executor(None, self._reap, self._proc)
        self._sock.close()

        async def spawn() -> tuple[subprocess.Popen, socket.socket, int, EngineStats, Any]:
            return await loop.run_in_executor(None, self._spawn)

        spawned, failures = await with_backoff(self.name, self._max_restart_attempts, self._restart_backoff_s, spawn)
        self.num_failed_restarts += failures
        if spawned is None:
            self.dead = f"{why}; {self._max_restart_attempts} restart attempts failed"
            log.error("engine %s declared dead: %s", self.name, self.dead)
            return False
        self._proc, self._sock, self._max_model_len, self._stats, _ = spawned
        self.num_restarts += 1
        self.dead = None
        log.warning("engine %s restarted (%d restart(s) so far)", self.name, self.num_restarts)
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description="an engine process; started by EngineProcess, not by hand")
    ap.add_argument("--fd", type=int, required=True, help="the inherited end of the parent's socketpair")
    ap.add_argument("--name", default="engine")
    args = ap.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the parent decides
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s engine-process[{args.name}]: %(message)s")
    _child_main(socket.socket(fileno=args.fd))


if __name__ == "__main__":
    main()
