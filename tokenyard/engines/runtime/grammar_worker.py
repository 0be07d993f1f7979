"""A schema's grammar compiled under a hard time and memory budget, in a small process of its own.

    worker = GrammarWorker(model_dir, GrammarBudget(time_s=5, memory_mb=1024), name="demo")
    await worker.check({"type": "json_schema", "schema": {...}})   # GrammarError when refused
    worker.close()

Why a process: compiling a JSON schema with xgrammar can take minutes and gigabytes (50 integer
properties with `multipleOf` 1024, 1023, ... took 24.5 s on SmolLM2's vocabulary; 200 took over
200 s), and C++ code running in a thread can be neither interrupted nor held to a memory limit.
Here the child compiles one schema at a time; one that runs past `time_s` is killed with its
process (the next check starts a fresh one), and the child's address space is capped at what it
used after start-up plus `memory_mb` (RLIMIT_AS), so a schema that needs more fails with bad_alloc
inside the child, or the child dies, and either way the schema is refused.

What comes back is a verdict, not the compiled grammar: xgrammar 0.2.9's CompiledGrammar.
serialize_json needed more than 24 GB for a five-property multipleOf grammar (measured), so the
grammar the engine uses is compiled again where the engine runs (tokenyard/engines/runtime/grammar_gate.py: on
a thread, which xgrammar's compiler leaves the GIL to: a 1 ms ticker thread saw at most 8 ms gaps
during a 0.85 s compile). The check costs one extra compile per new schema; verdicts are kept by
the schema's SHA-256 (VERDICTS of them, refusals too, so a flood of one hostile schema costs one
compile), and the engine's own compiled-grammar cache keeps the grammars.

The link: a socketpair, frames of a 4-byte big-endian length and a JSON object. Parent to child:
{"fmt": response_format}; child to parent: {"ready": true} once its vocabulary is built and one
grammar compiled (the library's first compile is start-up cost, seconds), then per
schema {"ok": true} or {"error": message}. Checks are serialised by a lock (one child, one
schema at a time); the child is started by `start()` (at engine start, so its vocabulary is warm)
or by the first check.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenyard.engines.core.structured_output import GrammarError, check_response_format, schema_text

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[3]    # holds tokenyard/: the child imports it from here
_HEADER = struct.Struct("!I")
VERDICTS = 4096              # schema verdicts remembered (LRU)
START_TIMEOUT_S = 300.0      # the child's vocabulary build (a GGUF tokenizer: seconds; not the schema's budget)


@dataclass(slots=True)
class GrammarBudget:
    """What one response_format may cost to compile: wall seconds, and MiB of memory above the
    compiler process's own footprint. Over either, the request is refused (400 response_format)."""

    time_s: float = 5.0
    memory_mb: int = 1024


def schema_key(fmt: dict) -> str:
    """SHA-256 of the compiled grammar's identity: the format's type and compact schema text."""
    return hashlib.sha256((fmt["type"] + ":" + schema_text(fmt)).encode()).hexdigest()


class GrammarWorker:
    def __init__(self, model_dir: str | Path, budget: GrammarBudget | None = None, name: str = "engine") -> None:
        self.model_dir = Path(model_dir)
        self.budget = budget or GrammarBudget()
        self.name = name
        self._proc: subprocess.Popen | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ready: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()   # digest -> None (ok) or the refusal
        self.num_killed = 0              # children killed for running past the time budget (or dying)

    async def start(self) -> None:
        """Start the child if none runs; it builds its vocabulary in the background."""
        if self._proc is None or self._proc.poll() is not None:
            await self._spawn()

    async def check(self, fmt: dict) -> None:
        """Compile `fmt` in the child within the budget; GrammarError (the refusal) otherwise."""
        check_response_format(fmt)
        digest = schema_key(fmt)
        if digest in self._verdicts:
            self._verdicts.move_to_end(digest)
            return self._raise(self._verdicts[digest])
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:   # one schema at a time: the child compiles with one thread
            if digest not in self._verdicts:
                self._remember(digest, await self._compile(fmt))
        return self._raise(self._verdicts[digest])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._kill()

    # -- the child, from the parent's side -------------------------------------------------------
    async def _compile(self, fmt: dict) -> str | None:
        await self.start()
        if self._proc is not None and self._ready is not None and not self._ready.done():
            set_idle(self._proc.pid, False)    # a request waits for this start: no longer idle-only work
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, RuntimeError) as e:
            self._kill()
            raise GrammarError(f"response_format is unavailable on engine {self.name}: the grammar compiler did "
                               f"not start ({type(e).__name__}: {e})") from None
        body = json.dumps({"fmt": fmt}).encode()
        self._writer.write(_HEADER.pack(len(body)) + body)
        try:
            reply = await asyncio.wait_for(_read(self._reader), self.budget.time_s)
        except asyncio.TimeoutError:
            self._kill()
            return (f"response_format schema is too expensive: compiling its grammar took longer than "
                    f"{self.budget.time_s:g} s; simplify the schema (fewer or shorter repetitions in patterns, "
                    f"fewer properties)")
        except (asyncio.IncompleteReadError, ConnectionError):
            self._kill()
            return (f"response_format schema is too expensive: compiling its grammar needed more than "
                    f"{self.budget.memory_mb} MiB (the compiler process ended); simplify the schema")
        except BaseException:
            # Cancelled (a batch line torn down, shutdown) with the frame sent: the reply would stay in the
            # socket and the next schema would read it as its own verdict. A fresh child instead.
            self._kill()
            raise
        return None if reply.get("ok") else str(reply.get("error") or "response_format schema cannot be compiled")

    async def _spawn(self) -> None:
        self._kill()
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from tokenyard.engines.runtime.grammar_worker import main; main()",
                    "--fd",
                    str(theirs.fileno()),
                    "--model",
                    str(self.model_dir),
                    "--memory-mb",
                    str(self.budget.memory_mb),
                    "--name",
                    self.name,
                ],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        # Its start-up (imports, vocabulary, first compile: seconds of CPU) runs in the idle class, on
        # cores the engine leaves free: at nice 19 alone it still took a share of a 2-core replica's
        # steps and made requests in that window 1.4x slower. A check waiting for it lifts it (_compile).
        set_idle(self._proc.pid, True)
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._ready = asyncio.get_running_loop().create_task(self._wait_ready(self._reader))

    @staticmethod
    async def _wait_ready(reader: asyncio.StreamReader) -> None:
        msg = await _read(reader)
        if not msg.get("ready"):
            raise RuntimeError(str(msg.get("error") or msg))

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        self._ready = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if proc is not None and proc.poll() is None:
            self.num_killed += 1
            proc.kill()
            try:
                proc.wait(5)        # SIGKILL: the kernel reaps it at once
            except subprocess.TimeoutExpired:
                log.warning("grammar worker of %s (pid %d) did not exit after SIGKILL", self.name, proc.pid)

    def _remember(self, digest: str, verdict: str | None) -> None:
        self._verdicts[digest] = verdict
        while len(self._verdicts) > VERDICTS:
            self._verdicts.popitem(last=False)

    @staticmethod
    def _raise(verdict: str | None) -> None:
        if verdict is not None:
            raise GrammarError(verdict)


async def _read(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return json.loads(await reader.readexactly(n))


# -- the child --------------------------------------------------------------------------------------
def _send(sock: socket.socket, msg: dict) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv(sock: socket.socket) -> dict | None:
    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exactly(_HEADER.size)
    if head is None:
        return None
    body = exactly(_HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


def set_idle(pid: int, idle: bool) -> bool:
    """Put process `pid` (0: this one) in the idle scheduling class (only CPU nobody else wants), or back
    in the normal one. False where the OS does not allow it (not Linux; a normal class refused)."""
    try:
        policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
        if os.sched_getscheduler(pid) != policy:
            os.sched_setscheduler(pid, policy, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


def _over_memory(memory_mb: int) -> str:
    return (f"response_format schema is too expensive: compiling its grammar needs more than {memory_mb} MiB; "
            f"simplify the schema")


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child_main(sock: socket.socket, model_dir: str, memory_mb: int) -> None:
    from tokenyard.engines.core.structured_output import Grammars
    from tokenyard.engines.text.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_dir(model_dir)
        grammars = Grammars.from_tokenizer(tok, tok.vocab_size, sorted(tok.eos_token_ids))
        # The library's first compile in a process costs seconds whatever the schema (5.2 s for a
        # one-string object or json_object on a 2-core AMD VM, then 10 ms for the next): start-up
        # work, not the schema's. Done here, before ready, it is never charged to a request's budget.
        grammars.compile({"type": "json_object"})
    except Exception as e:  # noqa: BLE001 - reported to the parent, which refuses with it
        _send(sock, {"error": f"{type(e).__name__}: {e}"})
        return
    # The budget is above what the process holds now (interpreter, library, vocabulary).
    limit = _vm_bytes() + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Started in the idle class (GrammarWorker._spawn); a check has a time budget, and an idle-class
    # process gets no CPU while the engine keeps every core busy: checks run at nice 19 instead.
    set_idle(0, False)
    _send(sock, {"ready": True})
    while (msg := _recv(sock)) is not None:
        try:
            grammars.compile(msg["fmt"])
            reply: dict[str, Any] = {"ok": True}
        except GrammarError as e:    # the library's bad_alloc arrives as a GrammarError naming it
            reply = {"error": _over_memory(memory_mb) if "bad_alloc" in str(e) else str(e)}
        except MemoryError:
            reply = {"error": _over_memory(memory_mb)}
        _send(sock, reply)


def main() -> None:
    ap = argparse.ArgumentParser(description="a grammar compile worker; started by GrammarWorker, not by hand")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-mb", type=int, required=True)
    ap.add_argument("--name", default="engine")
    args = ap.parse_args()
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the parent decides
    try:   # it builds its vocabulary right after the replica is ready: leave the cores to the first requests
        os.nice(19)
    except OSError:
        pass
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s grammar-worker[{args.name}]: %(message)s")
    try:
        _child_main(socket.socket(fileno=args.fd), args.model, args.memory_mb)
    except (OSError, KeyboardInterrupt):
        pass      # the parent hung up


if __name__ == "__main__":
    main()
