"""An engine stepped in a process of its own (the engine core), driven from the gateway's event loop.

    backend = EngineProcess(EngineRecipe("torch", model_dir, {"dtype": "float32"}), name="w2")  # blocks: loads
    backend = EngineProcess(recipe, name="w2", connect=Path("w2.sock"))   # a core the supervisor started
    await backend.start()
    stream = backend.add_request("r1", prompt_ids, params)     # the interface of AsyncEngine
    async for out in stream: ...
    backend.abort("r1"); await backend.stop()

Why a process: an in-process engine (tokenyard/engines/runtime/async_engine.py) steps on a thread beside the event
loop, and the two share Python's GIL. The step thread gives the GIL up inside every torch op and C
step and must win it back after each, while the event loop writes every stream's tokens; on two cores
the engine's pool threads wait for it too. Here the core runs one loop and nothing else (take the
messages that arrived, step, send the step's outputs as one message), and the parent's event loop
only reads one message per step and sends one per turn of its loop. It is the default for torch
engines (server.engine_process, tokenyard/gateway/backends/engine_pool.py says which engines).

The link (tokenyard/engines/serving/engine_link.py): frames of a 4-byte big-endian length and a
pickle. Parent to core, all the messages one turn of the event loop produced in one frame
("msgs", [...]): ("add", request_id, prompt_ids, params, priority, cache_salt), ("abort", request_id),
("grammar", token, response_format), ("sleep", level), ("wake",), ("adapter", "load"|"unload",
name, path) and ("embed", token, prompts) (process_embeddings.py). Core to parent: ("ready", max_model_len, stats, grammar_info,
embedding_size, startup_phases) once the engine is built (startup_phases: {phase: seconds} of building
it in the core, tokenyard/engines/core/startup_phases.py), ("out", outputs, stats, taken, others)
after each step (every output of the step in one frame; `taken`: adds the core took since its
previous frame; `others`: requests other gateway workers hold in the engine), ("grammar", token,
error or None), ("embedded", token, vectors or None, error or None), ("slept", seconds, None or
(kind, message)), ("woke", phases), ("adapter", result, None or (kind, message), stats) and ("failed",
message, exception). The parent never blocks on the core: its writes are buffered by asyncio, and
the core reads them between steps (a request waits at most one step to be admitted).

Back-pressure: at most `max_outstanding_adds` adds are on the wire or unread in the core at once
(sent, not yet reported `taken`); more wait here, in order, and go as the core reports taking
earlier ones; an abort of one still waiting here never reaches the core. So a core that falls behind
(a long step, a wake) costs the gateway a bounded buffer, and the event loop never waits.

Failures: a step that raises, an engine that reports itself dead (a tensor-parallel worker died) or a
core that exits: the requests that had received no token are kept and sent again to the fresh core
(at most `max_resubmits` times each: a request that kills every core it reaches is failed), the ones
already streaming end with an "error" output saying the engine restarted mid-stream (their tokens so
far stand; none is sent twice). Then the process is started again from the same recipe (or, with
`connect`, the link is made again to the core the supervisor restarts); while that runs new
requests raise EngineDeadError (503). A start that fails is retried `max_restart_attempts` times with
exponential backoff from `restart_backoff_s` (capped at 30 s); after that the engine stays dead and
the kept requests fail too. LoRA adapters loaded or unloaded at run time (load_adapter, unload_adapter)
are replayed on the fresh core before any request is sent again (adapter_replay.py), so a kept request
for a run-time adapter is served by it and an unloaded one stays unloaded.

Constrained requests: `await backend.prepare(params)` before add_request, as with AsyncEngine. The
schema is checked against its budget in a grammar worker of the parent's, then compiled on a thread
of the core, never on its step path (tokenyard/engines/serving/process_grammars.py). A request sent
again after a restart compiles its grammar in the fresh core when it is added.

Bad input: the core validates a request when it takes it, so a refusal (a bad grammar, a prompt too
long) arrives as the stream's first output, finished with finish_reason "error" and bad_request set;
the gateway answers it with a 400 as it does for a remote replica's refusal.

Sleep (tokenyard/engines/core/sleep_level.py): `await backend.sleep(level)` waits for the requests
in flight, then the core releases the memory; a request sent meanwhile is queued and the core's
next step wakes the engine; `await backend.wake()` wakes it at once. A wake that fails is a failed
process: its waiting requests are sent again to the fresh one.

Two engines in process mode step at the same time (in-process engines take turns on one thread,
tokenyard/engines/runtime/executor.py): give each its share of the cores (OMP_NUM_THREADS, the engine's threads).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Any

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.outputs import EngineStats, StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.async_engine import RequestStream, cancel_task, fail_streams, with_backoff
from tokenyard.engines.runtime.grammar_worker import GrammarBudget, GrammarWorker
from tokenyard.engines.serving.adapter_replay import AdapterChanges
from tokenyard.engines.serving.engine_child import _child_main  # noqa: F401 - re-exported
from tokenyard.engines.serving.engine_core import EngineRecipe, connect_core, reap, spawn_core
from tokenyard.engines.serving.engine_link import _HEADER, _frame, _Link, unpack  # noqa: F401 - _Link re-exported
from tokenyard.engines.serving.engine_process_sleep import ProcessSleep
from tokenyard.engines.serving.process_embeddings import ProcessEmbed
from tokenyard.engines.serving.process_grammars import ProcessGrammars

__all__ = ["EngineProcess", "EngineRecipe"]

log = logging.getLogger(__name__)


class EngineProcess(ProcessSleep, ProcessEmbed):
    """The EngineBackend (tokenyard/engines/core/backend.py) of an engine stepped in a core process."""

    def __init__(self, recipe: EngineRecipe, name: str = "engine", max_restart_attempts: int = 5,
                 restart_backoff_s: float = 0.5, *, connect: Path | None = None, max_outstanding_adds: int = 256,
                 max_resubmits: int = 2) -> None:
        self.recipe = recipe
        self.name = name
        self.connect = connect
        self.dead: str | None = None
        self.num_failed_steps = 0         # steps that raised (and engines that reported themselves dead)
        self.num_restarts = 0             # processes started again (links made again) after a failure
        self.num_failed_restarts = 0
        self.num_resubmitted = 0          # requests sent again to a fresh core (they had no token yet)
        self.others_in_flight = 0         # requests other gateway workers hold in the same core
        self.max_outstanding_adds = max(1, max_outstanding_adds)
        self.max_resubmits = max_resubmits
        self._max_restart_attempts = max_restart_attempts
        self._restart_backoff_s = restart_backoff_s
        self._streams: dict[str, RequestStream] = {}
        self._unstarted: dict[str, tuple] = {}   # add messages of requests without a token yet
        self._resubmits: dict[str, int] = {}
        self._held: deque[str] = deque()         # adds waiting for room under max_outstanding_adds
        self._outbox: list[tuple] = []            # this loop turn's messages, sent as one frame
        self._flush_handle: asyncio.Handle | None = None
        self._unacked = 0                         # adds sent, not yet reported taken by the core
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._sleep_level = 0
        self._waking_since: float | None = None      # loop time a wake began (by call or by a request)
        self._control_reply: asyncio.Future | None = None   # the answer to the sleep or wake under way
        self._control_lock: asyncio.Lock | None = None
        self.last_wake_s: float | None = None
        self.adapter_changes = AdapterChanges()       # run-time loads and unloads, replayed on a fresh core
        self._proc, self._sock, hello = self._spawn()
        _, self._max_model_len, self._stats, grammar, self._embedding_size, self.startup_phases = hello
        # The grammar worker is the parent's: it outlives the core's restarts, and so do its verdicts.
        # It starts in the first lull (its torch import beside the first requests slowed them 3x).
        self._grammars = None if grammar is None else ProcessGrammars(
            GrammarWorker(Path(grammar[0]), GrammarBudget(grammar[1], grammar[2]), name),
            idle=lambda: not self._streams and not self.others_in_flight)

    # -- the backend interface ----------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_held(self) -> int:
        """Adds waiting here for room under max_outstanding_adds."""
        return len(self._held)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def stats(self) -> EngineStats:
        """As the core sent it after its latest step (the whole engine's, all workers' requests)."""
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
        """Abort everything in flight, hang up (a core of its own exits) and wait for the process."""
        self._stopping = True
        for rid in list(self._streams):
            self.abort(rid)
        self._flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        await cancel_task(self._task)
        self._task = None
        if self._grammars is not None:
            self._grammars.close()
        self._sock.close()              # the core sees the end of its input and exits
        await asyncio.get_running_loop().run_in_executor(None, reap, self._proc)

    async def prepare(self, params: SamplingParams) -> None:
        """Make the request's grammar ready off the event loop and off the core's step; GrammarError
        when it is refused. Call add_request right after (no await between)."""
        if self._grammars is not None and params.response_format is not None:
            await self._grammars.prepare(params.response_format, self._send_grammar)

    def _send_grammar(self, token: int, fmt: dict) -> bool:
        if self.dead is not None or self._writer is None:
            return False
        self._send(("grammar", token, fmt))
        return True

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queue the request in the core; refusals come back as the stream's first output."""
        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name} is down: {self.dead}")
        if self._writer is None:
            raise EngineDeadError(f"engine {self.name} is not started")
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        if self._sleep_level and self._waking_since is None:   # the core's next step wakes the engine
            self._waking_since = asyncio.get_running_loop().time()
        self._unstarted[request_id] = ("add", request_id, list(prompt_token_ids), params, priority, cache_salt)
        self._held.append(request_id)
        self._release_held()
        return stream

    def abort(self, request_id: str) -> None:
        """End the stream with an "abort" output now; the core frees the request's blocks at its next step."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.put(StepOutput(request_id, [], finished=True, finish_reason="abort"))
        self._resubmits.pop(request_id, None)
        if self._unstarted.pop(request_id, None) is not None and request_id in self._held:
            self._held.remove(request_id)         # never sent: nothing to tell the core
            return
        if self._writer is not None:
            self._send(("abort", request_id))

    # -- LoRA adapters at run time (not in the recipe: remembered here, replayed on a fresh core) --------
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
        self.adapter_changes.record(op, name, path)
        return result

    # -- batching and back-pressure -------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        self._outbox.append(msg)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send this loop turn's messages as one frame."""
        self._flush_handle = None
        msgs, self._outbox = self._outbox, []
        if msgs and self._writer is not None:
            self._writer.write(_frame(msgs[0] if len(msgs) == 1 else ("msgs", msgs)))

    def _release_held(self) -> None:
        while self._held and self._unacked < self.max_outstanding_adds and self._writer is not None:
            msg = self._unstarted.get(self._held.popleft())
            if msg is not None:
                self._unacked += 1
                self._send(msg)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Hand each output to its stream; a request with a token is no longer one to send again."""
        streams, unstarted = self._streams, self._unstarted
        for out in outputs:
            rid = out.request_id
            stream = streams.get(rid)
            if stream is None:
                continue                    # aborted by its reader: nobody is listening
            if out.finished:
                del streams[rid]
                unstarted.pop(rid, None)
                self._resubmits.pop(rid, None)
            elif out.new_token_ids:
                unstarted.pop(rid, None)
                self._resubmits.pop(rid, None)
            stream.put(out)

    # -- the process ----------------------------------------------------------------------------
    def _spawn(self) -> tuple[subprocess.Popen | None, socket.socket, tuple]:
        """A core of our own (blocking until its engine is built), or a link to the supervisor's."""
        proc: subprocess.Popen | None = None
        if self.connect is not None:
            for _ in range(50):       # a core being started again: its socket comes back within seconds
                try:
                    sock, hello = connect_core(self.connect)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    time.sleep(0.1)
            else:
                sock, hello = connect_core(self.connect)     # the backoff's attempt: it logs why it failed
        else:
            proc, sock, hello = spawn_core(self.recipe, self.name)
        if self.adapter_changes:      # before any request reaches the fresh core (the loop has no writer yet)
            try:
                hello = self.adapter_changes.replay(sock, hello, self.recipe, self.name)
            except BaseException:
                sock.close()
                reap(proc)
                raise
        return proc, sock, hello

    async def _run(self) -> None:
        while True:
            reader, writer = await asyncio.open_unix_connection(sock=self._sock)
            self._writer = writer
            self._release_held()
            why = await self._pump(reader)
            if self._stopping:
                return
            self._writer = None
            writer.close()
            kept = self._core_gone(why)
            if not await self._restart(why):
                fail_streams(kept, f"engine {self.name}: {self.dead}", retryable=True)
                for rid in kept:
                    self._streams.pop(rid, None)
                    self._unstarted.pop(rid, None)
                self._held.clear()
                return
            self._held.extend(kept)          # first, in their order: the fresh core takes them as it starts
            self.num_resubmitted += len(kept)
            if kept:
                log.warning("engine %s: %d request(s) without a token yet sent again to the fresh core",
                            self.name, len(kept))

    def _core_gone(self, why: str) -> dict[str, RequestStream]:
        """The core failed: end the streams that had tokens; keep (and return) the ones to send again."""
        if self._grammars is not None:
            self._grammars.child_gone()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._outbox.clear()
        self._unacked = 0
        self._held.clear()
        kept: dict[str, RequestStream] = {}
        streaming: dict[str, RequestStream] = {}
        for rid, stream in self._streams.items():
            tries = self._resubmits.get(rid, 0)
            if rid in self._unstarted and tries < self.max_resubmits:
                self._resubmits[rid] = tries + 1
                kept[rid] = stream
            else:
                streaming[rid] = stream
                self._unstarted.pop(rid, None)
                self._resubmits.pop(rid, None)
        self._streams = kept
        fail_streams(streaming, f"engine {self.name} restarted while this request ran ({why}); the output "
                                "so far is all it gets")
        if self._control_reply is not None and not self._control_reply.done():
            self._control_reply.set_exception(EngineDeadError(f"engine {self.name}: {why}"))
        self._embeds_gone(why)
        self._sleep_level, self._waking_since = 0, None      # a fresh process starts awake
        return kept

    async def _pump(self, reader: asyncio.StreamReader) -> str:
        """Deliver the core's outputs until it fails or exits; returns why it stopped."""
        try:
            while True:
                (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                msg = pickle.loads(await reader.readexactly(n))
                kind = msg[0]
                if kind == "out":
                    self._deliver(msg[1])
                    if msg[2] is not None:     # a step ran: a sleeping engine woke for it
                        self._stats = msg[2]
                        if self._sleep_level:
                            self._awake()
                    if msg[3]:
                        self._unacked = max(0, self._unacked - msg[3])
                        self._release_held()
                    self.others_in_flight = msg[4]
                elif kind in ("slept", "woke", "adapter"):
                    if self._control_reply is not None and not self._control_reply.done():
                        self._control_reply.set_result(msg[1:])
                elif kind == "embedded":
                    self._embedded(msg)
                elif kind == "grammar":
                    if self._grammars is not None:
                        self._grammars.resolve(msg[1], msg[2])
                elif kind == "failed":
                    self.num_failed_steps += 1
                    return msg[1]
        except (pickle.UnpicklingError, ValueError, TypeError, IndexError, AttributeError) as e:
            return f"the engine process sent a message that could not be read: {type(e).__name__}: {e}"
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            if self._proc is None:
                return f"the engine core's link closed ({type(e).__name__})"
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._proc.wait, 1.0)
            except subprocess.TimeoutExpired:
                pass
            return f"the engine process exited (exit code {self._proc.returncode}; {type(e).__name__})"

    async def _restart(self, why: str) -> bool:
        """Start a fresh process from the recipe (or link again to the supervisor's fresh core); False
        when every attempt failed (the engine stays dead)."""
        loop = asyncio.get_running_loop()
        self.dead = f"restarting after: {why}"
        log.error("engine %s failed (%s); starting its process again", self.name, why)
        await loop.run_in_executor(None, reap, self._proc)
        self._sock.close()

        async def spawn() -> tuple[subprocess.Popen | None, socket.socket, tuple]:
            return await loop.run_in_executor(None, self._spawn)

        spawned, failures = await with_backoff(self.name, self._max_restart_attempts, self._restart_backoff_s, spawn)
        self.num_failed_restarts += failures
        if spawned is None:
            self.dead = f"{why}; {self._max_restart_attempts} restart attempts failed"
            log.error("engine %s declared dead: %s", self.name, self.dead)
            return False
        self._proc, self._sock, hello = spawned
        _, self._max_model_len, self._stats, _, self._embedding_size, _ = hello
        self.num_restarts += 1
        self.dead = None
        log.warning("engine %s restarted (%d restart(s) so far)", self.name, self.num_restarts)
        return True


if __name__ == "__main__":      # older launchers: the core's entry point moved to engine_core.py
    from tokenyard.engines.serving.engine_core import main
    main()
