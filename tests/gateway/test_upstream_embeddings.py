"""/v1/embeddings is passed through to an upstream engine that serves embeddings (issue 48.5): the
client names the engine, the reply is the upstream's under the engine's name, the spend record
prices the upstream's prompt tokens at the engine's input price; an engine that does not serve
embeddings is a 404 naming the model, bad input a 400 — never a 500."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from gateway_helpers import KEY, ROOT, running_gateway
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

openai = pytest.importorskip("openai")
SEEN: list[dict] = []


async def _embeddings(request):
    body = await request.json()
    SEEN.append({"body": body, "auth": request.headers.get("authorization")})
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    data = [{"object": "embedding", "index": i, "embedding": [0.5, float(len(str(x)))]} for i, x in enumerate(inputs)]
    return JSONResponse({"object": "list", "data": data, "model": body["model"],
                         "usage": {"prompt_tokens": 7 * len(inputs), "total_tokens": 7 * len(inputs)}})


async def _models(request):
    return JSONResponse({"object": "list", "data": [{"id": "emb-up", "object": "model"}]})


@pytest.fixture(scope="module")
def upstream():
    app = Starlette(routes=[Route("/v1/embeddings", _embeddings, methods=["POST"]), Route("/v1/models", _models)])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(5)


@pytest.fixture(scope="module")
def front(upstream):
    mp = pytest.MonkeyPatch()
    mp.setenv("TY_EMB_KEY", "sk-upstream-secret")
    records = []
    doc = {"server": {"access_log": False}, "engines": {
        "emb": {"type": "openai", "base_urls": [upstream + "/v1"], "upstream_model": "emb-up", "embeddings": True,
                "api_key_env": "TY_EMB_KEY", "prices": {"input": 100_000, "cached_input": 0, "output": 0}},
        "mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}}
    try:
        with running_gateway(doc, usage_sink=records.append) as srv:
            yield srv, records
    finally:
        mp.undo()


def test_embeddings_pass_through_and_are_billed(front):
    srv, records = front
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)
    r = client.embeddings.create(model="emb", input=["a", "bcd"])
    assert r.model == "emb" and [d.embedding for d in r.data] == [[0.5, 1.0], [0.5, 3.0]]
    assert SEEN[-1]["body"]["model"] == "emb-up" and SEEN[-1]["auth"] == "Bearer sk-upstream-secret"
    rec = records[-1]
    assert rec.api == "embeddings"
    assert rec.engine == "emb" and rec.prompt_tokens == 14 and rec.completion_tokens == 0
    assert rec.cost_micros == 14 * 100_000 // 10**6 and not rec.usage_estimated


def test_embeddings_refusals_are_openai_errors(front):
    srv, _ = front
    for body, status, param in (({"model": "mock", "input": "x"}, 404, "model"),
                                ({"model": "nope", "input": "x"}, 404, "model"),
                                ({"model": "emb", "input": []}, 400, "input"),
                                ({"model": "emb", "input": [True]}, 400, "input"),
                                ({"model": "emb"}, 400, "input"),
                                ({"input": "x"}, 400, "model")):
        status_got, _, data = srv.request("POST", "/v1/embeddings", body)
        assert status_got == status, (body, data)
        assert b'"param":"' + param.encode() in data.replace(b" ", b""), (body, data)
    status_got, _, data = srv.request("POST", "/v1/embeddings", b"[1]")
    assert status_got == 400
