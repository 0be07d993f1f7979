"""A minimal OpenAI-compatible server for benchmarks of upstream engines: canned chat completions
(JSON, or SSE with a usage chunk), answered at once, so what is measured in front of it is the
gateway's own cost. Not a test double for correctness (tests/gateway has those).

    TY_STUB_DELAY_MS=20 python -m tokenyard.bench.openai_stub --port 9100
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = ["The", " answer", " is", " four", "."]
DELAY_S = float(os.environ.get("TY_STUB_DELAY_MS", "0")) / 1000    # before each reply (and between chunks)


async def chat(request: Request) -> Response:
    body = await request.json()
    n = min(int(body.get("max_tokens") or len(WORDS)), len(WORDS))
    prompt = 10 + len(json.dumps(body.get("messages") or body.get("prompt") or "")) // 4
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if DELAY_S:
        await asyncio.sleep(DELAY_S)
    if not body.get("stream"):
        return JSONResponse({"id": "stub", "object": "chat.completion", "created": 0, "model": body.get("model"),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": "".join(WORDS[:n])}}],
                             "usage": usage})

    async def events():
        head = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": body.get("model")}
        for i, w in enumerate(WORDS[:n]):
            delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
            yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + "\n\n"
            if DELAY_S:
                await asyncio.sleep(DELAY_S / len(WORDS))
        yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({**head, "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])


def main() -> None:
    import uvicorn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=9100)
    args = ap.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
