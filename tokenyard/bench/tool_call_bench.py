"""Auto tool calls with SmolLM2-135M-Instruct (issue 45.6): how often the model calls a tool when one
is clearly needed, how often it calls one when none is, and whether the round trip (its call, the
tool's result, its answer) ends in a plain answer rather than template markup.

The prompts and the parsing are the gateway's own (tokenyard/gateway/prompt/rendering.tokenize with the request's
tools, tokenyard/gateway/http/tool_calls.ToolCallStream with tool_choice "auto"); the model runs in-process
through tokenyard.engines.LLM, greedy, with the default deployment's settings (int4 from the GGUF's Q4_1, fp32
activations). Each prompt style is measured: "smollm2" (the model card's function-calling format,
what the gateway now uses for this model) and "tags" (the generic preamble it used before).

    .venv/bin/python -m tokenyard.bench.tool_call_bench          # writes bench/results/tool_calls_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import re

from tokenyard.bench.results_io import RunRecorder
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.weights.gguf_models import smollm2_path
from tokenyard.gateway.edge.tool_request import parse_tools
from tokenyard.gateway.http.tool_calls import ToolCallStream, assemble
from tokenyard.gateway.prompt.tool_prompt import template_messages

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The current local time in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount between currencies",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                                    "to": {"type": "string"}}, "required": ["amount", "from", "to"]}}},
    {"type": "function", "function": {"name": "get_stock_price", "description": "The latest price of a stock",
     "parameters": {"type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}},
]
# (question, the function a call needs) - each one cannot be answered without its tool.
NEED_CALL = [
    ("What is the weather in Paris right now?", "get_weather"),
    ("Is it raining in London at the moment?", "get_weather"),
    ("How warm is it in Tokyo today?", "get_weather"),
    ("Tell me the current weather in Berlin.", "get_weather"),
    ("Should I take an umbrella in Madrid right now? Check the weather.", "get_weather"),
    ("What's the weather like in New York City now?", "get_weather"),
    ("What time is it in Sydney right now?", "get_time"),
    ("What is the local time in Los Angeles?", "get_time"),
    ("Tell me the current time in Cairo.", "get_time"),
    ("Is it night in Tokyo right now? Check the time.", "get_time"),
    ("What time is it now in Rome?", "get_time"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 50 euros?", "convert_currency"),
    ("Convert 20 British pounds to US dollars.", "convert_currency"),
    ("What is 300 Swiss francs in euros today?", "convert_currency"),
    ("What is the stock price of Apple (AAPL) right now?", "get_stock_price"),
    ("Get me the latest price of Microsoft stock, MSFT.", "get_stock_price"),
    ("How much is one Tesla share (TSLA) trading for now?", "get_stock_price"),
    ("What is NVDA trading at right now?", "get_stock_price"),
    ("Look up the current Amazon stock price (AMZN).", "get_stock_price"),
]
NO_CALL = [
    "Tell me a short joke about cats.",
    "What is 12 times 3?",
    "Write one sentence about the ocean.",
    "What is the capital of Italy?",
    "Say hello in Spanish.",
    "What colour do you get when you mix blue and yellow?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Name a fruit that is yellow.",
    "What is the opposite of cold?",
]
# Round trips: the call the model would make, the tool's result, and a word the answer should use.
ROUND_TRIPS = [
    ("What is the weather in Paris right now?", "get_weather", {"city": "Paris"}, "18 degrees and sunny"),
    ("What time is it in Sydney right now?", "get_time", {"city": "Sydney"}, "9:41 PM"),
    ("Convert 100 US dollars to euros.", "convert_currency", {"amount": 100, "from": "USD", "to": "EUR"}, "92.30 EUR"),
    ("What is the stock price of Apple (AAPL) right now?", "get_stock_price", {"symbol": "AAPL"}, "231.40 USD"),
    ("Is it raining in London at the moment?", "get_weather", {"city": "London"}, "light rain, 11 degrees"),
]
MARKUP = re.compile(r"<\|im_start\|>|<\|im_end\|>|</?tool_call>|</?tool_response>|</?tools>")


def _reply(llm: LLM, convs: list[list[dict]], style: str, max_tokens: int) -> list[tuple[str | None, list[dict], str]]:
    setup = parse_tools({"tools": TOOLS, "tool_choice": "auto"})
    tok = llm.tokenizer
    prompts = []
    for conv in convs:
        messages, tools = template_messages(conv, setup, style)
        prompts.append(tok.encode(apply_chat_template(tok, messages, tools=tools), add_special_tokens=False))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    results = []
    for out in outs:
        stream = ToolCallStream(setup)
        deltas = stream.feed(out.outputs[0].text)
        more, finish = stream.close(out.outputs[0].finish_reason)
        content, calls = assemble(deltas + more)
        results.append((content, calls, out.outputs[0].text))
    return results


def _measure(llm: LLM, style: str) -> tuple[dict, list[dict]]:
    need = _reply(llm, [[{"role": "user", "content": q}] for q, _ in NEED_CALL], style, 80)
    none = _reply(llm, [[{"role": "user", "content": q}] for q in NO_CALL], style, 80)
    convs = []
    for i, (q, fn, args, result) in enumerate(ROUND_TRIPS):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": fn, "arguments": json.dumps(args)}}
        convs.append([{"role": "user", "content": q}, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": f"call_{i}", "content": result}])
    trips = _reply(llm, convs, style, 60)
    called = [bool(calls) for _, calls, _ in need]
    right = [bool(calls) and calls[0]["function"]["name"] == fn for (_, calls, _), (_, fn) in zip(need, NEED_CALL)]
    false_calls = [bool(calls) for _, calls, _ in none]
    clean = [bool(content) and not calls and not MARKUP.search(content) for content, calls, _ in trips]
    uses = [bool(content) and any(w.lower() in content.lower() for w in re.findall(r"[\w.:]+", result))
            for (content, _, _), (_, _, _, result) in zip(trips, ROUND_TRIPS)]
    figures = {"style": style, "need_call_tasks": len(NEED_CALL), "no_call_tasks": len(NO_CALL),
               "auto_call_rate": sum(called) / len(called), "right_function_rate": sum(right) / len(right),
               "false_call_rate": sum(false_calls) / len(false_calls), "round_trips": len(ROUND_TRIPS),
               "round_trip_plain_answer_rate": sum(clean) / len(clean),
               "round_trip_uses_result_rate": sum(uses) / len(uses)}
    samples = [{"style": style, "kind": "need_call", "question": q, "raw": raw[:200]} for (q, _), (_, _, raw) in
               zip(NEED_CALL[:3], need[:3])]
    samples += [{"style": style, "kind": "round_trip", "question": q, "raw": raw[:200]} for (q, *_), (_, _, raw) in
                zip(ROUND_TRIPS, trips)]
    return figures, samples


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rec = RunRecorder("tool_calls_smollm2")
    llm = LLM(smollm2_path(), quantization="int4", quant_group_size=32, dtype="float32",
              kv_cache_memory=128 << 20, progress=False)
    runs, samples = [], []
    for style in ("smollm2", "tags"):
        figures, s = _measure(llm, style)
        runs.append(figures)
        samples += s
        print(json.dumps(figures))
    rec.write(figures={r["style"]: {k: v for k, v in r.items() if k != "style"} for r in runs},
              runs=runs + samples)


if __name__ == "__main__":
    main()
