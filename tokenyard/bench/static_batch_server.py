"""The naive baseline: transformers' generate behind the same chat API, with static batching.

    python -m tokenyard.bench.static_batch_server --model models/demo-large --port 8100 --batch-size 32 \
        [--batch-timeout-ms 50] [--api-key KEY | env TOKENYARD_API_KEY] [--dtype float32]

It speaks `POST /v1/chat/completions` like the gateway (stream and non-stream, stream_options.
include_usage, usage with prompt_tokens_details.cached_tokens = 0), so the load generator runs
the same load against both. What it does is what serving without continuous batching looks
like: requests wait in a queue; the batcher takes up to B of them (waiting at most
`batch_timeout_ms` after the first for more), left-pads them, runs ONE `model.generate` with
max_new_tokens = the batch's largest max_tokens, and only when the whole batch is done does any
of its requests get its text (a streamed reply comes out all at once). Requests that arrive
during a batch wait for the next one. Every row costs the longest row's steps.

Same weights and dtype as the engine: the same HF checkpoint folder through
AutoModelForCausalLM; prompts rendered with the same chat template and tokenizer
(tokenyard.engines.text.tokenizer / tokenyard.engines.text.chat_template) so the prompts are token-for-token the same.
One sampling setting per batch (the first request's): the benchmarks use temperature 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.text.tokenizer import Tokenizer


@dataclass(slots=True)
class StaticBatchConfig:
    model: Path
    batch_size: int = 32
    batch_timeout_ms: float = 50.0     # after the first request, wait this long for more to fill the batch
    dtype: str = "float32"             # the engine's CPU default, so both sides run the same arithmetic
    api_key: str | None = None         # None: no auth (loopback benchmarking only)
    name: str = "static-batch"         # the `model` the responses report
    default_max_tokens: int = 256


@dataclass(slots=True)
class Pending:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    done: asyncio.Future = field(repr=False)


@dataclass(slots=True)
class Generated:
    token_ids: list[int]
    text: str
    finish_reason: str


class BadRequest(Exception):
    def __init__(self, message: str, code: str = "invalid_request", status: int = 400) -> None:
        super().__init__(message)
        self.code, self.status = code, status


class StaticBatcher:
    """Owns the model; turns a queue of requests into one generate() call per batch."""

    def __init__(self, cfg: StaticBatchConfig) -> None:
        import transformers
        self.cfg = cfg
        self.tokenizer = Tokenizer.from_dir(cfg.model)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            cfg.model, dtype=getattr(torch, cfg.dtype)).eval()
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.eos_ids = list(self.tokenizer.eos_token_ids)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        self.queue: asyncio.Queue[Pending] = asyncio.Queue()
        self.batches = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, p: Pending) -> Generated:
        await self.queue.put(p)
        return await p.done

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.cfg.batch_timeout_ms / 1000
            while len(batch) < self.cfg.batch_size:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            batch = [p for p in batch if not p.done.done()]      # a client that left is not computed
            if not batch:
                continue
            try:
                # One torch workload at a time, off the event loop so streams keep flowing.
                results = await asyncio.to_thread(self._generate, batch)
            except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
                for p in batch:
                    if not p.done.done():
                        p.done.set_exception(e)
                continue
            self.batches += 1
            for p, r in zip(batch, results):
                if not p.done.done():
                    p.done.set_result(r)

    def _generate(self, batch: list[Pending]) -> list[Generated]:
        width = max(len(p.prompt_ids) for p in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(batch):                    # left padding: every row ends at column `width`
            ids[row, width - len(p.prompt_ids):] = torch.tensor(p.prompt_ids)
            mask[row, width - len(p.prompt_ids):] = 1
        new = max(p.max_tokens for p in batch)
        first = batch[0]
        sampling: dict[str, Any] = {"do_sample": False}
        if first.temperature > 0:
            sampling = {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p, "top_k": 0}
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                      eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id, **sampling)
        results = []
        for row, p in enumerate(batch):
            gen = out[row, width:].tolist()[:p.max_tokens]
            finish = "length"
            for i, t in enumerate(gen):
                if t in self.eos_ids:
                    gen, finish = gen[:i + 1], "stop"       # the EOS was computed: it counts as output
                    break
            text = self.tokenizer.decode([t for t in gen if t not in self.eos_ids], skip_special_tokens=True)
            for s in p.stop:
                if s and s in text:
                    text, finish = text[:text.index(s)], "stop"
            results.append(Generated(gen, text, finish))
        return results


def _error(status: int, message: str, code: str, etype: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": etype, "param": None, "code": code}}, status)


def _parse(body: Any, batcher: StaticBatcher, future: asyncio.Future) -> tuple[Pending, bool, bool]:
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise BadRequest("messages must be a non-empty list")
    try:
        prompt = apply_chat_template(batcher.tokenizer, body["messages"], tokenize=True)
    except ValueError as e:
        raise BadRequest(str(e), status=422, code="chat_template_error") from e
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or batcher.cfg.default_max_tokens
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise BadRequest("max_tokens must be a positive integer")
    if len(prompt) + max_tokens > batcher.max_len:
        raise BadRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) is over the model's "
                         f"{batcher.max_len}", code="context_length_exceeded")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
    top_p = float(body.get("top_p") or 1.0)
    stream = bool(body.get("stream", False))
    usage = bool((body.get("stream_options") or {}).get("include_usage", False))
    return Pending(prompt, max_tokens, temperature, top_p, stop, future), stream, usage


def _usage(p: Pending, g: Generated) -> dict[str, Any]:
    n = len(g.token_ids)
    return {"prompt_tokens": len(p.prompt_ids), "completion_tokens": n, "total_tokens": len(p.prompt_ids) + n,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _text_deltas(tokenizer: Tokenizer, ids: list[int], final: str) -> list[str]:
    """One delta per token, never splitting a UTF-8 character; the deltas join to `final`."""
    deltas, sent = [], ""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i], skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(sent):
            continue
        text = text[:len(final)] if len(text) > len(final) else text
        if text != sent and final.startswith(text):
            deltas.append(text[len(sent):])
            sent = text
    if sent != final:
        deltas.append(final[len(sent):])
    return deltas


def create_app(cfg: StaticBatchConfig, batcher: StaticBatcher | None = None) -> Starlette:
    state: dict[str, StaticBatcher] = {}

    def authorised(request: Request) -> bool:
        if not cfg.api_key:
            return True
        return request.headers.get("authorization", "") == f"Bearer {cfg.api_key}"

    async def chat(request: Request) -> Response:
        if not authorised(request):
            return _error(401, "invalid API key", "invalid_api_key", "authentication_error")
        b = state["batcher"]
        try:
            body = json.loads(await request.body())
            pending, stream, include_usage = _parse(body, b, asyncio.get_running_loop().create_future())
        except json.JSONDecodeError:
            return _error(400, "request body is not valid JSON", "invalid_json")
        except BadRequest as e:
            return _error(e.status, str(e), e.code)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if not stream:
            try:
                g = await b.submit(pending)
            except Exception as e:  # noqa: BLE001 - the batch failed: a 500 without the stack
                return _error(500, f"generation failed: {type(e).__name__}", "internal_error", "server_error")
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": cfg.name,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": g.text},
                                              "finish_reason": g.finish_reason}],
                                 "usage": _usage(pending, g)})

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": cfg.name, "choices": choices, **extra}) + "\n\n"

        async def events() -> AsyncIterator[str]:
            # The naive server has nothing to say until its batch is done; then all at once.
            try:
                g = await b.submit(pending)
            except Exception as e:  # noqa: BLE001
                yield "data: " + json.dumps({"error": {"message": f"generation failed: {type(e).__name__}",
                                                       "type": "server_error", "code": "internal_error"}}) + "\n\n"
                return
            finally:
                if not pending.done.done():
                    pending.done.cancel()
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for piece in _text_deltas(b.tokenizer, [t for t in g.token_ids if t not in b.eos_ids], g.text):
                yield chunk([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
            yield chunk([{"index": 0, "delta": {}, "finish_reason": g.finish_reason}])
            if include_usage:
                yield chunk([], usage=_usage(pending, g))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": cfg.name, "object": "model", "owned_by": "bench"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "batches": state["batcher"].batches if state else 0})

    async def lifespan(app: Starlette):  # noqa: ANN202 - Starlette's lifespan protocol
        state["batcher"] = batcher or await asyncio.to_thread(StaticBatcher, cfg)
        state["batcher"].start()
        yield
        await state["batcher"].stop()

    from contextlib import asynccontextmanager
    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/ready", health)],
                     lifespan=asynccontextmanager(lifespan))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint folder (with its tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batch-timeout-ms", type=float, default=50.0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--api-key", default=os.environ.get("TOKENYARD_API_KEY"),
                    help="require this bearer key (default: env TOKENYARD_API_KEY; unset: no auth)")
    ap.add_argument("--name", default="static-batch", help="the model name responses report")
    args = ap.parse_args(argv)
    import uvicorn
    cfg = StaticBatchConfig(Path(args.model), args.batch_size, args.batch_timeout_ms, args.dtype, args.api_key, args.name)
    print(f"static-batch baseline: {cfg.model} batch {cfg.batch_size} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
