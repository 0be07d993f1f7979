"""A reply's chat deltas as Anthropic Messages content blocks, for the stream and the whole reply alike.

The one flow's replies are text; with tools, tokenyard/gateway/http/tool_calls.py turns the text into
chat deltas ({"content": ...} and {"tool_calls": [...]}). `BlockStream` turns those deltas into the
Messages API's block events:

    content_block_start {index, content_block: {"type": "text", "text": ""}}
    content_block_delta {index, delta: {"type": "text_delta", "text": ...}}
    content_block_start {index, content_block: {"type": "tool_use", "id", "name", "input": {}}}
    content_block_delta {index, delta: {"type": "input_json_delta", "partial_json": ...}}
    content_block_stop  {index}

and `content_of(events)` assembles the non-streamed reply's `content` from the same events, so a
streamed and a whole reply can never disagree.
"""
from __future__ import annotations

import json
from typing import Any


class BlockStream:
    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None     # the open block: "text", "tool_use" or None
        self.tool_uses = 0

    def feed(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            text = d.get("content")
            if text:
                if self.kind != "text":
                    self._open(out, "text", {"type": "text", "text": ""})
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "text_delta", "text": text}})
            for call in d.get("tool_calls") or ():
                fn = call.get("function") or {}
                if "id" in call:
                    self.tool_uses += 1
                    self._open(out, "tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                 "name": fn.get("name"), "input": {}})
                args = fn.get("arguments")
                if args and self.kind == "tool_use":
                    out.append({"type": "content_block_delta", "index": self.index,
                                "delta": {"type": "input_json_delta", "partial_json": args}})
        return out

    def close(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._close(out)
        return out

    def _open(self, out: list[dict[str, Any]], kind: str, block: dict[str, Any]) -> None:
        self._close(out)
        self.index += 1
        self.kind = kind
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self, out: list[dict[str, Any]]) -> None:
        if self.kind is not None:
            out.append({"type": "content_block_stop", "index": self.index})
            self.kind = None


def tool_use_id(call_id: str) -> str:
    """Anthropic's id shape (toolu_...) for a call id the tool-call parser made (call_...)."""
    return "toolu_" + call_id[len("call_"):] if call_id.startswith("call_") else call_id


def content_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply's content blocks from its block events. A tool_use whose arguments are not a JSON
    object (a model's malformed call) is given back as the text it was, never as an invented input."""
    blocks: list[dict[str, Any]] = []
    raw: dict[int, list[str]] = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
            raw[e["index"]] = []
        elif e["type"] == "content_block_delta":
            delta = e["delta"]
            if delta["type"] == "text_delta":
                blocks[e["index"]]["text"] += delta["text"]
            else:
                raw[e["index"]].append(delta["partial_json"])
    out = []
    for i, block in enumerate(blocks):
        if block["type"] == "tool_use":
            text = "".join(raw[i]) or "{}"
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if not isinstance(value, dict):
                block = {"type": "text", "text": json.dumps({"name": block["name"], "arguments": text},
                                                            ensure_ascii=False)}
            else:
                block["input"] = value
        if out and block["type"] == "text" and out[-1]["type"] == "text":
            out[-1]["text"] += block["text"]
        else:
            out.append(block)
    return out


def stop_reason(finish_reason: str | None, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the flow's finish reason (after the tool-call parser's)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage_of(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache (the three
    input counts add up to the prompt, as Anthropic's do)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
