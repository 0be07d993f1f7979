"""The child's side of an engine process (tokenyard/engines/serving/engine_process.py): the link and the loop.

    _child_main(sock)     # take the recipe, build, then: take messages, step, send outputs

The loop: take the messages that arrived (block only while the engine has nothing to run), step,
send the step's outputs as one message; until the parent hangs up. Messages are frames of a 4-byte
big-endian length and a pickle (`_frame`); see engine_process.py for the ones each side sends.

Threads: the loop runs on the main thread. A constrained request's grammar is compiled on a thread
of its own (tokenyard/engines/serving/process_grammars.py: ChildCompiler), which sends its reply itself. So
`_Link.send` is serialised by a lock, and reads never change the socket's blocking mode (a
non-blocking read is one recv with MSG_DONTWAIT): a send from the compile thread can neither
interleave with the loop's nor turn the loop's draining read into one that blocks.
"""
from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from typing import Any

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.outputs import StepOutput
from tokenyard.engines.core.sampling_params import ParamError
from tokenyard.engines.core.sleep_level import SleepLevelError, SleepUnsupported
from tokenyard.engines.core.structured_output import GrammarError
from tokenyard.engines.serving.process_grammars import ChildCompiler, grammar_info

log = logging.getLogger("tokenyard.engines.serving.engine_process")

_HEADER = struct.Struct("!I")
_RECV_BYTES = 1 << 20


def _frame(msg: tuple) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class _Link:
    """The child's end (and the parent's during the start-up handshake): blocking or draining reads,
    sends from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)       # once: reads choose per call (MSG_DONTWAIT), sends always block
        self.sock = sock
        self.buf = bytearray()
        self.closed = False
        self._send_lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        data = _frame(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def receive(self, block: bool) -> list[tuple]:
        """The whole messages that have arrived; when `block`, waits for at least one (or the peer's end)."""
        msgs: list[tuple] = []
        while not self.closed:
            try:
                chunk = self.sock.recv(_RECV_BYTES, 0 if block and not msgs else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self.buf += chunk
            msgs.extend(self._parse())
        return msgs

    def _parse(self) -> list[tuple]:
        out, pos = [], 0
        while len(self.buf) - pos >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf, pos)
            end = pos + _HEADER.size + n
            if len(self.buf) < end:
                break
            out.append(pickle.loads(self.buf[pos + _HEADER.size:end]))
            pos = end
        del self.buf[:pos]
        return out


def _refusal(request_id: str, e: Exception) -> StepOutput:
    """A request the engine would not take, as its stream's only output (the gateway answers 400)."""
    if isinstance(e, EngineDeadError):
        return StepOutput(request_id, [], finished=True, finish_reason="error", error=str(e))
    param = code = None
    if isinstance(e, GrammarError):
        param = "grammar"
    elif isinstance(e, ParamError):
        param, code = e.param, e.code
    return StepOutput(request_id, [], finished=True, finish_reason="error", error=str(e), bad_request=True,
                      error_param=param, error_code=code)


def _picklable(e: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - the message still travels
        return None


def _child_main(sock: socket.socket) -> None:
    """The engine process: take the recipe, build, then take messages, step and send outputs until the
    parent hangs up."""
    link = _Link(sock)
    first = link.receive(block=True)
    if not first or first[0][0] != "recipe":
        return
    recipe: Any = first[0][1]
    try:
        engine = recipe.build()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        link.send(("failed", f"building the engine raised {type(e).__name__}: {e}", _picklable(e)))
        return
    grammars = grammar_info(engine)
    compiler = ChildCompiler(engine, link.send) if grammars is not None else None
    link.send(("ready", engine.max_model_len, engine.stats(), grammars))
    try:
        _serve(link, engine, compiler)
    except OSError:
        return       # the parent hung up while a step ran (it stopped, or died): nobody to tell
    finally:
        if compiler is not None:
            compiler.close()
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _sleep_or_wake(link: _Link, engine: Any, msg: tuple) -> bool:
    """("sleep", level) -> ("slept", seconds, None) or ("slept", None, (kind, message)); ("wake",) ->
    ("woke", phases). A wake that raises is reported as "failed" (False: the loop ends, the parent
    starts a fresh process, as after a failed step)."""
    if msg[0] == "sleep":
        if not hasattr(engine, "sleep"):
            link.send(("slept", None, ("unsupported", "this engine cannot sleep")))
        else:
            try:
                link.send(("slept", engine.sleep(msg[1]), None))
            except (RequestError, ValueError) as e:
                kind = ("level" if isinstance(e, SleepLevelError) else "unsupported"
                        if isinstance(e, SleepUnsupported) else "busy" if isinstance(e, RequestError) else "unsupported")
                link.send(("slept", None, (kind, str(e))))
        return True
    try:
        link.send(("woke", engine.wake() if hasattr(engine, "wake") else {}))
    except Exception as e:  # noqa: BLE001 - the engine's state is unknown: the parent restarts it
        log.exception("engine process: wake failed")
        link.send(("failed", f"engine wake failed: {type(e).__name__}: {e}", None))
        return False
    return True


def _adapter(link: _Link, engine: Any, msg: tuple) -> None:
    """("adapter", "load", name, path) / ("adapter", "unload", name, None) -> ("adapter", result, None, stats)
    or ("adapter", None, (kind, message), stats) (tokenyard/engines/lora/adapter_errors.py); between steps. The
    stats carry the adapters' names, so the parent's are current without waiting for a step."""
    from tokenyard.engines.lora.adapter_errors import error_kind

    _, op, name, path = msg
    fn = getattr(engine, f"{op}_adapter", None)
    if fn is None:
        link.send(("adapter", None, ("unsupported", "this engine cannot load or unload LoRA adapters"), None))
        return
    try:
        result = fn(name, path) if op == "load" else fn(name)
    except Exception as e:  # noqa: BLE001 - an adapter that cannot load leaves the engine as it was
        found = error_kind(e)
        if found is None:
            log.exception("engine process: %s of LoRA adapter %s failed", op, name)
            found = ("invalid", f"{type(e).__name__}: {e}")
        link.send(("adapter", None, found, engine.stats()))
        return
    link.send(("adapter", result, None, engine.stats()))


def _serve(link: _Link, engine: Any, compiler: ChildCompiler | None) -> None:
    while True:
        refused: list[StepOutput] = []
        for msg in link.receive(block=not engine.has_unfinished()):
            if msg[0] == "add":
                try:
                    engine.add_request(*msg[1:])
                except (RequestError, EngineDeadError, ValueError, TypeError, KeyError) as e:
                    refused.append(_refusal(msg[1], e))
            elif msg[0] == "abort":
                engine.abort(msg[1])
            elif msg[0] in ("sleep", "wake"):   # the parent drained first; a failed wake ends the process
                if not _sleep_or_wake(link, engine, msg):
                    return
            elif msg[0] == "adapter":        # a LoRA adapter loaded or unloaded at run time
                _adapter(link, engine, msg)
            elif msg[0] == "grammar":        # compiled on the compiler's thread, which replies
                if compiler is not None:
                    compiler.submit(msg[1], msg[2])
                else:
                    link.send(("grammar", msg[1], "response_format is not supported by this engine"))
        if link.closed:
            return
        outputs: list[StepOutput] = []
        if engine.has_unfinished():
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - the parent fails the requests and starts afresh
                log.exception("engine process: step failed")
                link.send(("failed", f"engine step failed: {type(e).__name__}: {e}", None))
                return
        if outputs or refused:
            link.send(("out", refused + outputs, engine.stats() if outputs else None))
        dead = getattr(engine, "dead", None)
        if dead:
            link.send(("failed", f"engine failed: {dead}", None))
            return
