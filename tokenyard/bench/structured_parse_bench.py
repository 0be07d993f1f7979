"""The openai SDK's `client.chat.completions.parse()` on SmolLM2 through the gateway (issue 45).

    python -m tokenyard.bench.structured_parse_bench [--requests 50] [--max-tokens 1024] [--concurrency 4]

`tokenyard serve` runs tokenyard/deploy/default.yaml cut down to its smollm2-135m engine (as `make serve` serves
it) in a process of its own; the SDK sends `requests` parse() calls round-robin over six ordinary pydantic
models (an unbounded float, a bounded int with a bool, an enum list, a nested object, optional fields,
a list of objects), a different prompt each, temperature 0 and 0.8 alternately (seeded).

A reply is valid when it finishes with "stop", the SDK parses it into the model and it validates against
the model's JSON schema. Reported: the share valid, the completion-token distribution (p50, p99, max)
and the longest valid reply, against the goal: 100% valid, p99 under twice the longest valid reply
(a reply that loops until max_tokens misses both). Writes bench/results/structured_parse_smollm2.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any, Optional

import jsonschema
import openai
from pydantic import BaseModel, Field

from tokenyard.bench.results_io import RunRecorder
from tokenyard.bench.serve_launch import OUT, ROOT, derive_deployment, gateway_process

ENGINE = "smollm2-135m"


class City(BaseModel):           # the model: SmolLM2 wrote 1.0000000000000012111111... to max_tokens
    name: str
    country: str
    population_millions: float


class Order(BaseModel):
    item: str
    quantity: int = Field(ge=1, le=100)
    express: bool


class Colour(str, Enum):
    red = "red"
    orange = "orange"
    yellow = "yellow"
    green = "green"
    blue = "blue"
    purple = "purple"
    black = "black"
    white = "white"


class Palette(BaseModel):
    colours: list[Colour]


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    address: Address


class Contact(BaseModel):
    name: str
    email: Optional[str] = None
    age: Optional[int] = None


class Member(BaseModel):
    name: str
    role: str


class Team(BaseModel):
    team: str
    members: list[Member]


PROMPTS: dict[type[BaseModel], list[str]] = {
    City: ["Describe Paris.", "Describe Tokyo.", "Describe Cairo.", "Describe Lima.", "Describe Oslo.",
           "Describe Mumbai.", "Describe Toronto.", "Describe Sydney.", "Describe Berlin."],
    Order: ["I want 3 apples delivered fast.", "Order 12 pencils, no rush.", "Two pizzas, express please.",
            "A box of 50 nails.", "One laptop, standard delivery.", "Seven roses, as fast as possible.",
            "Ten notebooks.", "Order 4 chairs for the office, express."],
    Palette: ["The colours of the French flag.", "Colours of a sunset.", "Colours of a forest.",
              "The colours of a rainbow.", "Colours of the sea.", "Colours of a zebra.", "Colours of autumn.",
              "Colours of a traffic light."],
    Person: ["Alice lives at 12 Oak Street in Boston.", "Bob's address is 4 Rue de Rivoli, Paris.",
             "Carla lives on 9 Via Roma in Milan.", "Dan, 221B Baker Street, London.",
             "Eve lives at 1 Main Street, Springfield.", "Frank's home: 77 Sunset Boulevard, Los Angeles.",
             "Grace lives at 5 King Street, Sydney.", "Hiro lives at 3 Sakura Road, Kyoto."],
    Contact: ["Contact: Jane Doe, jane@example.com, 34 years old.", "John Smith, no email given.",
              "Maria, 28.", "Contact Li Wei at li.wei@example.org.", "Ahmed, age 45, ahmed@example.net.",
              "Olga Petrova.", "Contact: Tom, tom@example.com.", "Sara, 19 years old, sara@example.com."],
    Team: ["The Beatles: John sings, Paul plays bass.", "Our team: Ann is the manager, Ben the developer.",
           "Apollo 11 crew: Neil commander, Buzz pilot.", "The kitchen: Marco chef, Lea waiter.",
           "A band with a drummer and a guitarist.", "The support team: Kim and Raj, both engineers.",
           "Project X: Ada leads, Alan tests.", "A football team's coach and captain."],
}


def _ask(client: openai.OpenAI, model: type[BaseModel], prompt: str, i: int, max_tokens: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": "Reply with JSON only."},
                {"role": "user", "content": prompt}]
    temperature = 0.0 if i % 2 == 0 else 0.8
    t0 = time.perf_counter()
    row: dict[str, Any] = {"model": model.__name__, "prompt": prompt, "temperature": temperature, "seed": i}
    try:
        r = client.chat.completions.parse(model=ENGINE, messages=messages, response_format=model,
                                          temperature=temperature, seed=i, max_tokens=max_tokens)
        choice = r.choices[0]
        row.update(finish_reason=choice.finish_reason, completion_tokens=r.usage.completion_tokens,
                   text=choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())
        row["valid"] = choice.finish_reason == "stop" and isinstance(choice.message.parsed, model)
    except openai.LengthFinishReasonError as e:       # parse() raises on "length"
        row.update(finish_reason="length", completion_tokens=e.completion.usage.completion_tokens,
                   text=e.completion.choices[0].message.content[:2000], valid=False)
    except Exception as e:  # noqa: BLE001 - a parse or schema failure is a result, recorded
        row.update(valid=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    row["seconds"] = round(time.perf_counter() - t0, 3)
    print(f"{i:3d} {model.__name__:8s} {row.get('finish_reason')} {row.get('completion_tokens')} tokens "
          f"valid={row['valid']} {row['seconds']:.0f} s", file=sys.stderr, flush=True)
    return row


def _grammar_closed(base_url: str, api_key: str) -> int:
    """The engine's count of replies its grammar_close_reserve ended, from the gateway's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    req = urllib.request.Request(base_url + "/metrics", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "tokenyard_engine_grammar_closed_total" and s.labels.get("engine") == ENGINE))


def _percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run(requests: int, max_tokens: int, concurrency: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    config = derive_deployment(ROOT / "tokenyard" / "deploy" / "default.yaml", OUT / "structured_parse.yaml",
                               only_engines=[ENGINE])
    models = list(PROMPTS)
    jobs = [(models[i % len(models)], PROMPTS[models[i % len(models)]][(i // len(models)) % 8], i)
            for i in range(requests)]
    with gateway_process(config, name="structured-parse", model=ENGINE)() as ep:
        client = openai.OpenAI(base_url=ep.base_url + "/v1", api_key=ep.api_key, max_retries=0, timeout=600)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            rows = list(pool.map(lambda job: _ask(client, *job, max_tokens=max_tokens), jobs))
        wall = time.perf_counter() - t0
        closed = _grammar_closed(ep.base_url, ep.api_key)
    tokens = [r["completion_tokens"] for r in rows if "completion_tokens" in r]
    valid = [r for r in rows if r.get("valid")]
    longest_valid = max((r["completion_tokens"] for r in valid), default=0)
    p99 = _percentile(tokens, 0.99) if tokens else 0.0
    figures = {
        "requests": requests, "max_tokens": max_tokens, "valid": len(valid), "valid_share": len(valid) / requests,
        "finish_length": sum(r.get("finish_reason") == "length" for r in rows),
        # replies the engine's grammar_close_reserve ended (tokenyard_engine_grammar_closed_total)
        "closed_by_reserve": closed,
        "errors": sum("error" in r for r in rows),
        "completion_tokens_p50": statistics.median(tokens) if tokens else 0, "completion_tokens_p99": p99,
        "completion_tokens_max": max(tokens, default=0), "longest_valid_tokens": longest_valid,
        "goal_met": len(valid) == requests and p99 < 2 * longest_valid, "wall_s": round(wall, 1),
        "per_model": {m.__name__: {"valid": sum(r.get("valid", False) for r in rows if r["model"] == m.__name__),
                                   "requests": sum(r["model"] == m.__name__ for r in rows),
                                   "max_tokens_seen": max((r.get("completion_tokens", 0) for r in rows
                                                           if r["model"] == m.__name__), default=0)}
                      for m in models},
    }
    return figures, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    recorder = RunRecorder("structured_parse_smollm2")
    figures, rows = run(args.requests, args.max_tokens, args.concurrency)
    recorder.write(figures, rows, engine=ENGINE, deployment="tokenyard/deploy/default.yaml (smollm2-135m only)")
    print(json.dumps({k: v for k, v in figures.items() if k != "per_model"}, indent=1))
    for name, f in figures["per_model"].items():
        print(f"  {name:8s} valid {f['valid']}/{f['requests']}  max tokens {f['max_tokens_seen']}")


if __name__ == "__main__":
    main()
