"""One engine as its own process: the AsyncEngine interface over a small internal HTTP API.

    POST /v1/engine/generate   {"request_id", "prompt_token_ids", "params", "priority", "cache_salt"}
                               -> 200 and NDJSON, one StepOutput (its fields) per line, the last
                                  one finished; 400 {"error"} bad input (a response_format over its
                                  compile budget: kind "grammar"); 503 {"error"} draining or down
                               "kv_handle"? (decode role: a shared-memory KV payload to import first)
    POST /v1/engine/prefill    prefill role: {"request_id", "prompt_token_ids", "cache_salt", "transport":
                               "shm"|"tcp", "kv_host"?, "kv_port"?, "timeout_s"?} -> 200 {"transport",
                               "handle"? (shm), "import"? (tcp), "num_blocks", "num_tokens", "bytes",
                               "prefill_s", "export_s", "send_s"}; 400 bad input; 409 not a prefill
                               replica; 502 {"stage": "transfer"} the decode side did not take the KV;
                               503 draining, down, or the prefill failed (engines/serving/kv_handover.py)
    POST /v1/engine/abort      {"request_id"} -> 200 {"aborted": bool}
    POST /v1/engine/sleep      {"level": 1|2, "drain_timeout_s"?} -> 200 {"sleep_level", "sleep_state",
                               "seconds"} once the requests in flight finished and the memory is
                               released; 400 {"error", "param": "level"} a bad level; 409 requests
                               still in flight after the drain timeout, or an engine that cannot sleep
    POST /v1/engine/wake       -> 200 {"sleep_level": 0, "sleep_state", "seconds", "phases"}; 503 the
                               wake failed (the replica is down or restarting)
    POST /v1/engine/adapters/load    {"name", "path"} -> 200 what was loaded (rank, modules, seconds);
                               400 {"error", "code"} an adapter this base or pool cannot serve (names the
                               tensor) or an engine without adapters; 409 the name is taken
    POST /v1/engine/adapters/unload  {"name"} -> 200 {"unloaded"}; 404 no such adapter; 409 requests still
                               run with it (they finish; unload again after)
    GET  /v1/engine/adapters   {"adapters": names a request may use, "resident": those in a pool slot}
    GET  /v1/engine/stats      EngineStats fields + name, max_model_len, in_flight, draining, dead,
                               failed_steps, model_fingerprint
    GET  /health               liveness: {"status": "ok"|"down", "ready", "draining"} (503 when down)
    GET  /ready                200 while it takes new requests, else 503
    GET  /metrics              a few Prometheus gauges (running, waiting, KV usage, ...) of this replica

The gateway (tokenyard/gateway/backends/remote_engine.py) keeps one keep-alive connection pool per replica. A
client that goes away mid-stream (the gateway aborting, or dying) aborts its request here, so
the engine frees the blocks at its next step; so does one that goes away during a POST /v1/engine/prefill
(the disaggregated flow aborted, or its gateway gone): the prefill is cancelled, not run to the end.
SIGTERM drains: /ready turns false, new requests get 503 (the gateway retries them elsewhere: no token
was sent), requests in flight run to the end for up to `grace_s`, then the process exits 0; a second
signal exits at once.

A request with a response_format has its grammar made ready first (`engine.prepare`: checked in a
grammar worker under its time and memory budget, compiled on a thread), so neither this event loop
nor the engine's step ever compiles one.

Sleep (tokenyard/engines/core/sleep_level.py): a sleeping replica stays ready and keeps taking
requests; the first one wakes the engine and waits for it (AsyncEngine), so none is refused or lost.
Its state is in /health, the stats document (sleep_level, sleep_state, last_wake_s) and
tokenyard_engine_sleep_level; gateways read it from there. An engine stepped in a process of its
own (server.engine_process) sleeps in that process (engine_process.py).

Nothing here imports gateway/: starlette and uvicorn are imported when the server is built.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from tokenyard.engines.core.errors import EngineDeadError, HandoverError, RequestError
from tokenyard.engines.core.sampling_params import ParamError, SamplingParams
from tokenyard.engines.core.sleep_level import AWAKE, SleepBusy, SleepLevelError, SleepUnsupported
from tokenyard.engines.core.startup_phases import StartupPhases, process_age_s
from tokenyard.engines.core.structured_output import GrammarError
from tokenyard.engines.runtime.async_engine import AsyncEngine

if TYPE_CHECKING:      # a replica without a hand-over role never imports the KV transfer code (torch)
    from tokenyard.engines.serving.kv_handover import KVHandover

log = logging.getLogger("tokenyard.replica")

API = "/v1/engine"


class ReplicaState:
    """What the endpoints share: the engine, the drain flag, requests being streamed."""

    def __init__(self, engine: AsyncEngine, model_fingerprint: str = "", handover: KVHandover | None = None) -> None:
        self.engine = engine
        self.model_fingerprint = model_fingerprint
        self.handover = handover    # role prefill or decode (disaggregated serving); None: role both
        self.draining = False
        self.ready = False
        self.streaming = 0          # generate responses still open
        self.preparing = 0          # generate requests whose grammar is being made ready
        # Seconds per start-up phase, process start to ready when serve() was given them, else the engine's own.
        self.startup: dict[str, float] = dict(getattr(engine, "startup_phases", None) or {})


async def _unless_disconnected(request: Any, work: Any) -> Any:
    """Await `work` unless the client disconnects first: then cancel it (KVHandover.prefill aborts its
    request in the engine, freeing its blocks) and return None. The body was read, so the next ASGI
    message is the disconnect (uvicorn sends it when the connection closes: a gateway that aborted the
    request, timed out, or died)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    try:
        return await task         # done: its reply or its error; cancelled: its finally (the abort) has run
    except asyncio.CancelledError:
        return None


async def _disconnect(request: Any) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(state: ReplicaState):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    engine = state.engine

    async def generate(request: Request) -> Any:
        if state.draining or not state.ready:
            return JSONResponse({"error": "draining" if state.draining else "starting", "retryable": True}, 503)
        try:
            body = json.loads(await request.body())
            rid = body["request_id"]
            ids = body["prompt_token_ids"]
            params = body.get("params") or {}
            priority = int(body.get("priority", 0))
            salt = body.get("cache_salt")
            kv_handle = body.get("kv_handle")
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": f"bad request body: {e}"}, 400)
        if kv_handle is not None:
            if state.handover is None:
                log.warning("request %s came with a KV handle but this replica's role is both: recomputed", rid)
            else:   # the blocks a prefill replica computed: registered in the prefix cache, hit below
                await state.handover.import_handle(kv_handle)
        try:
            if not isinstance(params, dict):
                raise RequestError(f"params must be an object, got {type(params).__name__}")
            params = SamplingParams.from_dict(params)
            if params.response_format is not None:
                # Checked against its budget and compiled off this loop and off the step (the
                # engine's grammar gate); add_request follows with no await between.
                state.preparing += 1
                try:
                    await engine.prepare(params)
                finally:
                    state.preparing -= 1
            stream = engine.add_request(rid, ids, params, priority=priority, cache_salt=salt)
        except GrammarError as e:        # before RequestError, its base: the schema is the problem
            return JSONResponse({"error": str(e), "param": "response_format", "kind": "grammar"}, 400)
        except ParamError as e:
            return JSONResponse({"error": str(e), "param": e.param, "code": e.code, "kind": "param"}, 400)
        except (RequestError, ValueError, TypeError) as e:
            return JSONResponse({"error": str(e)}, 400)
        except EngineDeadError as e:
            return JSONResponse({"error": str(e), "retryable": True}, 503)
        return _NDJSONStream(state, rid, stream)

    async def prefill(request: Request) -> Response:
        handover = state.handover
        if handover is None or handover.role != "prefill":
            return JSONResponse({"error": f"replica role is {handover.role if handover else 'both'}, not prefill",
                                 "code": "wrong_role"}, 409)
        if state.draining or not state.ready:
            return JSONResponse({"error": "draining" if state.draining else "starting", "retryable": True}, 503)
        try:
            body = json.loads(await request.body())
            args = (str(body["request_id"]), body["prompt_token_ids"], body.get("cache_salt"),
                    body.get("transport", "shm"), body.get("kv_host"), body.get("kv_port"))
            timeout = float(body.get("timeout_s", 60.0))
            if not 0 < timeout <= 3600:
                raise ValueError(f"timeout_s must be in (0, 3600] seconds, got {timeout!r}")
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": f"bad request body: {e}"}, 400)
        try:
            reply = await _unless_disconnected(request, handover.prefill(*args, timeout_s=timeout))
            if reply is None:          # the gateway went away: the prefill was cancelled, its blocks freed
                log.info("prefill of %s aborted: the gateway closed its connection", args[0])
                return Response(status_code=499)
        except HandoverError as e:
            code = 502 if e.stage == "transfer" else 503
            return JSONResponse({"error": str(e), "stage": e.stage, "retryable": True}, code)
        except EngineDeadError as e:
            return JSONResponse({"error": str(e), "stage": "prefill", "retryable": True}, 503)
        except (RequestError, ValueError, TypeError) as e:
            return JSONResponse({"error": str(e)}, 400)
        return JSONResponse(reply)

    async def abort(request: Request) -> Response:
        try:
            rid = json.loads(await request.body())["request_id"]
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": f"bad request body: {e}"}, 400)
        known = rid in engine._streams
        engine.abort(rid)
        return JSONResponse({"aborted": known})

    async def stats(request: Request) -> Response:
        return JSONResponse(stats_document(state))

    async def sleep(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
            if not isinstance(body, dict):
                raise TypeError("the body must be a JSON object")
            timeout = body.get("drain_timeout_s", 30.0)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 3600:
                return JSONResponse({"error": f"drain_timeout_s must be a number of seconds in [0, 3600], got "
                                              f"{timeout!r}", "param": "drain_timeout_s"}, 400)
        except (ValueError, TypeError) as e:
            return JSONResponse({"error": f"bad request body: {e}"}, 400)
        if not hasattr(engine, "sleep"):
            return JSONResponse({"error": f"engine {engine.name} cannot sleep",
                                 "code": "sleep_not_supported"}, 409)
        try:
            seconds = await engine.sleep(body.get("level"), float(timeout))
        except SleepLevelError as e:
            return JSONResponse({"error": str(e), "param": "level", "code": "invalid_sleep_level"}, 400)
        except SleepUnsupported as e:
            return JSONResponse({"error": str(e), "code": "sleep_not_supported"}, 409)
        except SleepBusy as e:
            return JSONResponse({"error": str(e), "code": "replica_busy"}, 409)
        except EngineDeadError as e:
            return JSONResponse({"error": str(e), "code": "replica_down"}, 503)
        return JSONResponse({"sleep_level": engine.sleep_level, "sleep_state": engine.sleep_state,
                             "seconds": seconds})

    async def wake(request: Request) -> Response:
        if not hasattr(engine, "wake"):
            return JSONResponse({"error": f"engine {engine.name} cannot sleep",
                                 "code": "sleep_not_supported"}, 409)
        t0 = time.perf_counter()
        try:
            phases = await engine.wake()
        except Exception as e:  # noqa: BLE001 - the engine failed its waiting requests and restarts or is dead
            return JSONResponse({"error": f"waking failed: {type(e).__name__}: {e}", "code": "replica_down",
                                 "retryable": True}, 503)
        return JSONResponse({"sleep_level": engine.sleep_level, "sleep_state": engine.sleep_state,
                             "seconds": time.perf_counter() - t0, "phases": phases})

    async def adapters(request: Request) -> Response:
        st = engine.stats()
        return JSONResponse({"adapters": list(st.lora_names), "resident": list(st.lora_resident)})

    async def adapter_control(request: Request) -> Response:
        """The gateway checked the path against its lora_roots; the path is this replica's."""
        from tokenyard.engines.lora.adapter_errors import STATUS, error_kind

        op = request.path_params["op"]
        if op not in ("load", "unload"):
            return JSONResponse({"error": f"no adapter action {op!r} (load, unload)"}, 404)
        try:
            body = json.loads(await request.body() or b"{}")
            if not isinstance(body, dict) or not isinstance(body.get("name"), str):
                raise TypeError("the body must be a JSON object with a string name")
            if op == "load" and not isinstance(body.get("path"), str):
                raise TypeError("a load needs a string path")
        except (ValueError, TypeError) as e:
            return JSONResponse({"error": f"bad request body: {e}"}, 400)
        fn = getattr(engine, f"{op}_adapter", None)
        if fn is None:
            return JSONResponse({"error": f"engine {engine.name} cannot load or unload LoRA adapters",
                                 "code": "unsupported"}, 400)
        try:
            result = await (fn(body["name"], body["path"]) if op == "load" else fn(body["name"]))
        except EngineDeadError as e:
            return JSONResponse({"error": str(e), "code": "replica_down"}, 503)
        except Exception as e:  # noqa: BLE001 - adapter errors map to their status; anything else is a 400 too
            kind, message = error_kind(e) or ("invalid", f"{type(e).__name__}: {e}")
            return JSONResponse({"error": message, "code": kind}, STATUS[kind])
        return JSONResponse(result if op == "load" else {"unloaded": body["name"]})

    async def health(request: Request) -> Response:
        down = engine.dead is not None
        body = {"status": "down" if down else "ok", "ready": state.ready and not state.draining and not down,
                "draining": state.draining, "sleep_state": getattr(engine, "sleep_state", AWAKE)}
        return JSONResponse(body, 503 if down else 200)

    async def ready(request: Request) -> Response:
        ok = state.ready and not state.draining and engine.dead is None
        return JSONResponse({"ready": ok, "draining": state.draining}, 200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(metrics_text(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    return Starlette(routes=[
        Route(f"{API}/generate", generate, methods=["POST"]),
        Route(f"{API}/prefill", prefill, methods=["POST"]),
        Route(f"{API}/abort", abort, methods=["POST"]),
        Route(f"{API}/stats", stats, methods=["GET"]),
        Route(f"{API}/sleep", sleep, methods=["POST"]),
        Route(f"{API}/wake", wake, methods=["POST"]),
        Route(f"{API}/adapters", adapters, methods=["GET"]),
        Route(API + "/adapters/{op:str}", adapter_control, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ])


def stats_document(state: ReplicaState) -> dict[str, Any]:
    eng = state.engine
    doc = asdict(eng.stats())
    doc.update(name=eng.name, max_model_len=eng.max_model_len, in_flight=eng.num_in_flight,
               draining=state.draining, dead=eng.dead, failed_steps=eng.num_failed_steps,
               model_fingerprint=state.model_fingerprint, sleep_level=getattr(eng, "sleep_level", 0),
               sleep_state=getattr(eng, "sleep_state", AWAKE), last_wake_s=getattr(eng, "last_wake_s", None))
    doc.update(state.handover.stats() if state.handover is not None else {"role": "both", "kv_port": None})
    return doc


def metrics_text(state: ReplicaState) -> str:
    """Gauges for an autoscaler that scrapes replicas directly (label engine, like the gateway's)."""
    eng, s = state.engine, state.engine.stats()
    name = eng.name.replace("\\", "\\\\").replace('"', '\\"')
    rows = [("tokenyard_engine_running_requests", "Sequences running in the engine", s.num_running),
            ("tokenyard_engine_waiting_requests", "Requests waiting inside the engine", s.num_waiting),
            ("tokenyard_engine_kv_usage_ratio", "Fraction of KV-cache blocks in use", s.kv_usage),
            ("tokenyard_engine_kv_bytes_per_block", "Bytes of one KV-cache block (all layers, K and V, scales)",
             s.kv_bytes_per_block),
            ("tokenyard_engine_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / admitted",
             s.prefix_cache_hit_rate),
            ("tokenyard_engine_in_flight_requests", "Requests streaming from this replica", eng.num_in_flight),
            ("tokenyard_engine_max_num_seqs", "Most sequences in one step", s.max_num_seqs),
            ("tokenyard_engine_draining", "1 while the replica drains after SIGTERM", int(state.draining)),
            ("tokenyard_engine_sleep_level", "0 awake, 1 KV cache released, 2 weights dropped too",
             getattr(eng, "sleep_level", 0))]
    out = []
    for metric, help_, value in rows:
        out += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge", f'{metric}{{engine="{name}"}} {value}']
    if state.startup:
        out += ["# HELP tokenyard_engine_startup_seconds Seconds from process start to ready, per phase",
                "# TYPE tokenyard_engine_startup_seconds gauge"]
        out += [f'tokenyard_engine_startup_seconds{{engine="{name}",phase="{phase}"}} {s}'
                for phase, s in state.startup.items()]
    return "\n".join(out) + "\n"


class _NDJSONStream:
    """The outputs of one request as NDJSON lines; a client that leaves aborts the request."""

    def __init__(self, state: ReplicaState, request_id: str, stream) -> None:
        self.state = state
        self.request_id = request_id
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        state, rid = self.state, self.request_id
        state.streaming += 1
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        finished = False
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
            while not finished:
                outs = [await self.stream.get()]
                while (more := self.stream.get_nowait()) is not None:   # one write for what piled up
                    outs.append(more)
                finished = any(o.finished for o in outs)
                data = b"".join(json.dumps(asdict(o), separators=(",", ":")).encode() + b"\n" for o in outs)
                await send({"type": "http.response.body", "body": data, "more_body": not finished})
        except OSError:
            pass                                      # the client is gone: abort below
        finally:
            watcher.cancel()
            if not finished:
                state.engine.abort(rid)
            state.streaming -= 1

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.state.engine.abort(self.request_id)     # wakes the writer with the "abort" output


def serve(engine: AsyncEngine, host: str, port: int, grace_s: float = 30.0, model_fingerprint: str = "",
          announce=lambda line: print(line, flush=True), startup: StartupPhases | None = None,
          handover: KVHandover | None = None, kv_port: int = 0) -> int:
    """Run a replica until SIGTERM/SIGINT (drain) and return the exit status. startup: the phases
    measured so far since the process started (`tokenyard engine serve`); from here to ready is
    warm_up (engine start, server bind), and the whole is closed at the process's age when ready.
    handover: a prefill or decode role (kv_handover.py); a decode replica takes KV payloads over TCP
    on host:kv_port (0: any free port; the stats document says which)."""
    import uvicorn

    serve_t0 = time.perf_counter()

    state = ReplicaState(engine, model_fingerprint, handover)
    app = build_app(state)

    class _Server(uvicorn.Server):
        drain_requested = False
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig, frame) -> None:     # signal handler: set flags only
            if self.drain_requested:
                self.should_exit = self.force_exit = True
            self.drain_requested = True

        async def startup(self, sockets=None) -> None:
            await engine.start()
            if handover is not None and handover.role == "decode":
                await handover.start_receiver(host, kv_port)
                announce(f"tokenyard: decode replica takes KV payloads on {host}:{handover.receiver.port}")
            await super().startup(sockets)
            if startup is not None:
                startup.add("warm_up", time.perf_counter() - serve_t0)
                age = process_age_s()
                startup.finish(age if age is not None else sum(startup.seconds.values()))
                state.startup = startup.as_dict()
                log.info("replica %s ready in %s", engine.name, startup.describe())
            state.ready = True

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested and self.drain_task is None:
                state.draining = True
                log.info("replica %s draining: %d request(s) in flight", engine.name, engine.num_in_flight)
                self.drain_task = asyncio.get_running_loop().create_task(self._drain())
            return await super().on_tick(counter)

        async def _drain(self) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace_s
            while (engine.num_in_flight or state.streaming or state.preparing) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            if engine.num_in_flight:
                log.warning("drain grace of %.1f s over; cutting %d request(s)", grace_s, engine.num_in_flight)
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if handover is not None:
                await handover.close()
            await engine.stop()

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=1, lifespan="off")
    server = _Server(config)
    announce(f"tokenyard: engine {engine.name} replica at http://{host}:{port} (internal API {API})")
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0 if server.started else 1
