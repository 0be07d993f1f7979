"""A Responses API reply built from chat-style deltas: the output items and the typed stream events.

The request flow makes chat deltas ({"content": ...} and {"tool_calls": [...]} as
tokenyard/gateway/http/tool_calls.py parses them, or an upstream engine's chunks); this turns them into
what the openai SDK's Responses types parse, with one `sequence_number` per event:

    response.created, response.in_progress
    response.output_item.added (message) -> response.content_part.added (output_text)
      response.output_text.delta ... -> response.output_text.done -> response.content_part.done
    response.output_item.done (message)
    response.output_item.added (function_call) -> response.function_call_arguments.delta ...
      -> response.function_call_arguments.done -> response.output_item.done (function_call)
    response.completed (or response.incomplete when max_output_tokens cut it), with usage

A non-streamed reply is the same builder's final object (its events unused), so the two can never
disagree. Text before a call is one message item, each call a function_call item, in the order made.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any


def chat_usage_to_responses(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's usage object in the Responses API's names."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0)},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.get("total_tokens", 0)}


class ResponseBuilder:
    def __init__(self, response_id: str, model: str, echo: dict[str, Any]) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        self.model = model
        self.echo = echo                    # the request's fields the object repeats (tools, text, ...)
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None    # the item being written
        self._seq = 0
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.incomplete: dict[str, Any] | None = None

    # -- the object ---------------------------------------------------------------------------
    def response(self) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "background": False, "error": None, "incomplete_details": self.incomplete, "model": self.model,
                "output": [dict(item) for item in self.items], "reasoning": None, "service_tier": "default",
                "usage": self.usage, **self.echo}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    # -- building -----------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = delta.get("content")
        if text:
            if self._open is None or self._open["type"] != "message":
                out += self._close_open("completed")
                out += self._open_message()
            self._open["content"][0]["text"] += text
            out.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=self._index,
                                  content_index=0, delta=text, logprobs=[]))
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call or self._open is None or self._open["type"] != "function_call":
                out += self._close_open("completed")
                item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call", "status": "in_progress",
                        "call_id": call.get("id") or "call_" + secrets.token_hex(12), "name": fn.get("name") or "",
                        "arguments": ""}
                self._add(item)
                out.append(self.event("response.output_item.added", output_index=self._index, item=dict(item)))
            args = fn.get("arguments") or ""
            if args:
                self._open["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                      output_index=self._index, delta=args))
        return out

    def close(self, finish_reason: str | None, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The last events; the object's status from the finish reason ("length": incomplete)."""
        out: list[dict[str, Any]] = []
        if not self.items:            # an empty reply is still one (empty) message
            out += self._open_message()
        cut = finish_reason == "length"
        out += self._close_open("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if cut else None
        self.usage = chat_usage_to_responses(usage)
        out.append(self.event("response.incomplete" if cut else "response.completed", response=self.response()))
        return out

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error after the stream began: the error event, then response.failed."""
        self.status = "failed"
        return [self.event("error", code=error.get("code"), message=error.get("message", ""),
                           param=error.get("param")),
                self.event("response.failed", response={**self.response(), "error": {
                    "code": error.get("code") or "server_error", "message": error.get("message", "")}})]

    # -- items --------------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "status": "in_progress", "content": []}
        self._add(item)
        added = self.event("response.output_item.added", output_index=self._index, item=_copy(item))
        item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        part = self.event("response.content_part.added", item_id=item["id"], output_index=self._index,
                          content_index=0, part=dict(item["content"][0]))
        return [added, part]

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        i = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            return [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                               part=dict(part)),
                    self.event("response.output_item.done", output_index=i, item=_copy(item))]
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=i, item=dict(item))]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(p) for p in item.get("content", ())]}


def output_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply's items as chat messages (what a later turn's previous_response_id continues from)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def sse_event(event: dict[str, Any]) -> bytes:
    """One typed event as server-sent event bytes (its type as the SSE `event:` name, as OpenAI sends it)."""
    return (b"event: " + event["type"].encode() + b"\ndata: "
            + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")
