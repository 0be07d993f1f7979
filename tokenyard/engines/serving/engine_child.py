"""The engine core's side of an engine process (tokenyard/engines/serving/engine_process.py): its loop.

    _child_main(sock)                    # one gateway process: take the recipe, build, serve that link
    _child_main(sock, listener)          # several: serve every link accepted on `listener` (server.workers)

The loop: take the messages that arrived on every link (block only while the engine has nothing to
run), step, send each link the step's outputs for its requests as one frame, until the parent hangs up
(one link) or the process is stopped (a listener: the supervisor, tokenyard/gateway/server/supervisor.py,
ends it). Frames and threads: tokenyard/engines/serving/engine_link.py.

Several links (gateway worker processes) share the one engine: each link's request ids are its own (the
core names them "<link>:<id>" inside the engine and strips that on the way out), a link that goes away
has its requests aborted, and every link gets a frame after every step, outputs or not, with the
engine's stats and `others`, the requests the other links hold in the engine, so each worker's
admission counts the whole engine (tokenyard/gateway/admission/engine_queues.py). `taken` counts the
adds the core took since its last frame to that link: the parent's bound on adds in flight
(engine_process.py, back-pressure) is released by it.

With several links no send blocks the core: each link has an outbox (link_outbox.py) that the loop
writes as the socket takes it, and a worker that stopped reading (its outbox past MAX_OUTBOX_BYTES, or
nothing taken for `stall_s`, server.worker_stall_s) is dropped like a link that closed, so the other
workers keep being served. A single link (one gateway process, the core's only parent) keeps blocking
sends: there is nobody else to serve, and dropping it would end the core.
"""
from __future__ import annotations

import gc
import logging
import pickle
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.outputs import StepOutput
from tokenyard.engines.core.sampling_params import ParamError
from tokenyard.engines.core.sleep_level import SleepLevelError, SleepUnsupported
from tokenyard.engines.core.startup_phases import process_age_s
from tokenyard.engines.core.structured_output import GrammarError
from tokenyard.engines.serving.engine_link import _HEADER, _frame, _Link  # noqa: F401 - re-exported
from tokenyard.engines.serving.link_outbox import DEFAULT_STALL_S, Outbox
from tokenyard.engines.serving.process_embeddings import CoreEmbeddings, embedding_size
from tokenyard.engines.serving.process_grammars import ChildCompiler, grammar_info
from tokenyard.kernels import page_reserve

log = logging.getLogger("tokenyard.engines.serving.engine_process")


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


@dataclass(eq=False)
class _Peer:
    """One gateway process's link and what it holds in the engine."""

    link: _Link
    no: int
    prefix: str                                       # "" with a single link: ids go in as they are
    rids: set[str] = field(default_factory=set)       # its requests in the engine (the core's names)
    outs: list[StepOutput] = field(default_factory=list)
    taken: int = 0
    outbox: Outbox | None = None                      # several links: sends that never block (link_outbox.py)
    writing: bool = False                             # registered for EVENT_WRITE (its outbox waits)

    def send(self, msg: tuple) -> bool:
        if self.outbox is not None:
            return self.outbox.send(_frame(msg))
        try:
            self.link.send(msg)
            return True
        except OSError:
            self.link.closed = True
            return False


class _Core:
    def __init__(self, engine: Any, listener: socket.socket | None, stall_s: float = DEFAULT_STALL_S,
                 imports_s: float = 0.0) -> None:
        self.engine = engine
        self._imports_s = imports_s           # this process's start and imports, before the engine was built
        self.listener = listener
        self.stall_s = stall_s
        self.num_dropped_links = 0            # workers dropped for not reading
        self.peers: dict[int, _Peer] = {}
        self.owner: dict[str, tuple[_Peer, str]] = {}   # core name -> (peer, its own id)
        self.sel = selectors.DefaultSelector()
        self._next = 0
        self.compiler = ChildCompiler(engine, self._grammar_reply) if grammar_info(engine) is not None else None
        self.embeds = CoreEmbeddings(engine)
        # A grammar reply left in an outbox by the compile thread wakes the loop to write it.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if listener is not None:
            listener.setblocking(False)
            self.sel.register(listener, selectors.EVENT_READ, None)

    def ready_msg(self) -> tuple:
        phases = getattr(self.engine, "startup_phases", None)     # what building the engine took, by phase
        reported = phases.as_dict() if phases is not None else {}
        if self._imports_s:
            reported = {**reported, "imports": reported.get("imports", 0.0) + self._imports_s}
        return ("ready", self.engine.max_model_len, self.engine.stats(), grammar_info(self.engine),
                embedding_size(self.engine), reported)

    def add_peer(self, link: _Link) -> _Peer:
        self._next += 1
        peer = _Peer(link, self._next, f"{self._next}:" if self.listener is not None else "",
                     outbox=Outbox(link.sock, self.stall_s) if self.listener is not None else None)
        self.peers[peer.no] = peer
        self.sel.register(link.sock, selectors.EVENT_READ, peer)
        return peer

    def drop_peer(self, peer: _Peer) -> None:
        """A gateway process went away: its requests are aborted (nobody reads them)."""
        self.peers.pop(peer.no, None)
        self.embeds.drop(peer.send)
        try:
            self.sel.unregister(peer.link.sock)
        except (KeyError, ValueError):
            pass
        for name in peer.rids:
            self.owner.pop(name, None)
            self.engine.abort(name)
        peer.rids.clear()
        peer.link.sock.close()

    def _grammar_reply(self, msg: tuple) -> None:
        """From the compile thread: ("grammar", (peer no, token), error) to that peer."""
        no, token = msg[1]
        peer = self.peers.get(no)
        if peer is not None:
            peer.send(("grammar", token, msg[2]))
            if peer.outbox is not None and peer.outbox.pending:
                try:
                    self._wake_w.send(b"w")
                except OSError:
                    pass          # a wake is already waiting to be read

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
        for peer in list(self.peers.values()):
            self.drop_peer(peer)
        self._wake_r.close()
        self._wake_w.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # -- the loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished() or bool(self.embeds)
            waiting = any(p.writing for p in self.peers.values())
            for key, events in self.sel.select(timeout=0 if busy else 0.1 if waiting else None):
                if key.data is None:
                    self._accept()
                    continue
                if key.data == "wake":
                    self._drain_wakes()
                    continue
                peer = key.data
                if peer.no not in self.peers:
                    continue                   # dropped earlier in this turn
                if events & selectors.EVENT_WRITE and peer.outbox is not None and not peer.outbox.flush():
                    self._drop_slow(peer)
                    continue
                if not events & selectors.EVENT_READ:
                    continue
                if not self._take(peer, peer.link.receive(block=False)):
                    return
                if peer.link.closed:
                    self.drop_peer(peer)
            if self.listener is None and not self.peers:
                return                     # the only parent hung up
            stats = None
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - the parents fail the requests and start afresh
                    log.exception("engine process: step failed")
                    self._fail(f"engine step failed: {type(e).__name__}: {e}")
                    return
                stats = engine.stats()
                self._route(outputs)
            if self.embeds:                 # one batch of embeddings per turn, between steps
                self.embeds.run_one()
            self._send_frames(stats)
            if self.listener is not None:
                self._watch_outboxes()
            dead = getattr(engine, "dead", None)
            if dead:
                self._fail(f"engine failed: {dead}")
                return

    def _watch_outboxes(self) -> None:
        """Drop the links that stopped reading; ask the selector for writability where bytes wait."""
        now = time.monotonic()
        for peer in list(self.peers.values()):
            box = peer.outbox
            if box is None:
                continue
            if box.failed is not None or box.stalled(now):
                self._drop_slow(peer)
                continue
            want = bool(box.pending)
            if want != peer.writing:
                peer.writing = want
                self.sel.modify(peer.link.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0), peer)

    def _drop_slow(self, peer: _Peer) -> None:
        why = peer.outbox.failed if peer.outbox is not None else None
        log.warning("engine core: dropping gateway link %d (%s); its %d request(s) are aborted", peer.no,
                    why or "its link failed", len(peer.rids))
        self.num_dropped_links += 1
        self.drop_peer(peer)

    def _drain_wakes(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        peer = self.add_peer(_Link(sock))
        if not peer.send(self.ready_msg()):
            self._drop_slow(peer)

    def _take(self, peer: _Peer, msgs: list[tuple]) -> bool:
        """Apply one peer's messages; False when the loop must end (a failed wake)."""
        engine = self.engine
        for msg in msgs:
            kind = msg[0]
            if kind == "add":
                rid = msg[1]
                name = peer.prefix + rid
                peer.taken += 1
                try:
                    engine.add_request(name, *msg[2:])
                except (RequestError, EngineDeadError, ValueError, TypeError, KeyError) as e:
                    peer.outs.append(_refusal(rid, e))
                    continue
                peer.rids.add(name)
                if peer.prefix:
                    self.owner[name] = (peer, rid)
            elif kind == "abort":
                name = peer.prefix + msg[1]
                if name in peer.rids:
                    peer.rids.discard(name)
                    self.owner.pop(name, None)
                    engine.abort(name)
            elif kind in ("sleep", "wake"):   # the parent drained first; a failed wake ends the process
                if not _sleep_or_wake(peer, engine, msg):
                    self._fail("engine wake failed", skip=peer)
                    return False
            elif kind == "adapter":           # a LoRA adapter loaded or unloaded at run time
                _adapter(peer, engine, msg)
            elif kind == "embed":             # computed between steps (process_embeddings.py)
                self.embeds.submit(peer.send, msg[1], msg[2])
            elif kind == "grammar":           # compiled on the compiler's thread, which replies
                if self.compiler is not None:
                    self.compiler.submit((peer.no, msg[1]), msg[2])
                else:
                    peer.send(("grammar", msg[1], "response_format is not supported by this engine"))
        return True

    def _route(self, outputs: list[StepOutput]) -> None:
        if self.listener is None:
            peer = next(iter(self.peers.values()), None)
            if peer is not None:
                peer.outs.extend(outputs)
                for out in outputs:
                    if out.finished:
                        peer.rids.discard(out.request_id)
            return
        for out in outputs:
            owner = self.owner.get(out.request_id)
            if owner is None:
                continue                    # its link went away
            peer, rid = owner
            if out.finished:
                del self.owner[out.request_id]
                peer.rids.discard(out.request_id)
            out.request_id = rid
            peer.outs.append(out)

    def _send_frames(self, stats: Any) -> None:
        """One frame per link: its outputs, the stats when a step ran, the adds taken and the others'
        requests. With several links every link hears of every step (the stats are the whole engine's)."""
        total = sum(len(p.rids) for p in self.peers.values())
        several = self.listener is not None
        for peer in list(self.peers.values()):
            if not (peer.outs or peer.taken or (several and stats is not None)):
                continue
            outs, peer.outs = peer.outs, []
            taken, peer.taken = peer.taken, 0
            if not peer.send(("out", outs, stats, taken, total - len(peer.rids))):
                self._drop_slow(peer)

    def _fail(self, message: str, skip: _Peer | None = None) -> None:
        for peer in list(self.peers.values()):
            if peer is not skip:
                peer.send(("failed", message, None))


def _sleep_or_wake(peer: _Peer, engine: Any, msg: tuple) -> bool:
    """("sleep", level) -> ("slept", seconds, None) or ("slept", None, (kind, message)); ("wake",) ->
    ("woke", phases). A wake that raises is reported as "failed" (False: the loop ends, the parent
    starts a fresh process, as after a failed step)."""
    if msg[0] == "sleep":
        if not hasattr(engine, "sleep"):
            peer.send(("slept", None, ("unsupported", "this engine cannot sleep")))
        else:
            try:
                peer.send(("slept", engine.sleep(msg[1]), None))
            except (RequestError, ValueError) as e:
                kind = ("level" if isinstance(e, SleepLevelError) else "unsupported"
                        if isinstance(e, SleepUnsupported) else "busy" if isinstance(e, RequestError) else "unsupported")
                peer.send(("slept", None, (kind, str(e))))
        return True
    try:
        peer.send(("woke", engine.wake() if hasattr(engine, "wake") else {}))
    except Exception as e:  # noqa: BLE001 - the engine's state is unknown: the parent restarts it
        log.exception("engine process: wake failed")
        peer.send(("failed", f"engine wake failed: {type(e).__name__}: {e}", None))
        return False
    return True


def _adapter(peer: _Peer, engine: Any, msg: tuple) -> None:
    """("adapter", "load", name, path) / ("adapter", "unload", name, None) -> ("adapter", result, None, stats)
    or ("adapter", None, (kind, message), stats) (tokenyard/engines/lora/adapter_errors.py); between steps. The
    stats carry the adapters' names, so the parent's are current without waiting for a step."""
    from tokenyard.engines.lora.adapter_errors import error_kind

    _, op, name, path = msg
    fn = getattr(engine, f"{op}_adapter", None)
    if fn is None:
        peer.send(("adapter", None, ("unsupported", "this engine cannot load or unload LoRA adapters"), None))
        return
    try:
        result = fn(name, path) if op == "load" else fn(name)
    except Exception as e:  # noqa: BLE001 - an adapter that cannot load leaves the engine as it was
        found = error_kind(e)
        if found is None:
            log.exception("engine process: %s of LoRA adapter %s failed", op, name)
            found = ("invalid", f"{type(e).__name__}: {e}")
        peer.send(("adapter", None, found, engine.stats()))
        return
    peer.send(("adapter", result, None, engine.stats()))


def _child_main(sock: socket.socket, listener: socket.socket | None = None, stall_s: float = DEFAULT_STALL_S,
                own_process: bool = False) -> None:
    """The engine process: take the recipe on `sock`, build, then serve: `sock` alone, or (with a
    listener) every link accepted there, `sock` being only the supervisor's handshake. own_process:
    this is the core's process (engine_core.main), whose collector it may tune; tests run the loop
    on a thread of theirs."""
    link = _Link(sock)
    first = link.receive(block=True)
    if not first or first[0][0] != "recipe":
        return
    recipe: Any = first[0][1]
    # This interpreter's start and its imports (torch's, the engine's) are start-up time too, before
    # the engine's own phases begin: the hello reports them as the core's "imports".
    imports_s = process_age_s() or 0.0
    if own_process and getattr(recipe, "kind", None) == "torch":
        # the C step's huge pages, faulted in on the idle core while this thread imports torch
        page_reserve.start(page_reserve.hint_key(recipe.kind, recipe.model, recipe.options))
    try:
        t0 = time.perf_counter()
        if hasattr(recipe, "engine_class"):    # EngineRecipe; a test's own recipe may only build()
            recipe.engine_class()
        imports_s += time.perf_counter() - t0
        engine = recipe.build()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        link.send(("failed", f"building the engine raised {type(e).__name__}: {e}", _picklable(e)))
        return
    finally:
        page_reserve.release()           # a reservation the build did not take (no C step)
    # The build leaves ~180,000 live objects (SmolLM2) and almost no garbage (20 unreachable). Left in
    # the collector's generations, the full collections they trigger (85 ms each on a 2-core VM) fell on
    # the first requests: the engine's steps were ~9% slower for the first second after ready. Frozen,
    # the collector never scans them again; what the engine allocates while serving is collected as before.
    if own_process:
        gc.freeze()
    core = _Core(engine, listener, stall_s, imports_s)
    link.send(core.ready_msg())
    if listener is None:
        core.add_peer(link)
    else:
        sock.close()            # the supervisor watches the process itself
    try:
        core.serve()
    except OSError:
        return       # the parent hung up while a step ran (it stopped, or died): nobody to tell
    finally:
        core.close()
