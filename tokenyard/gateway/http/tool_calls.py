"""Tool calls out of the model's text (the prompt side: tokenyard/gateway/prompt/tool_prompt.py).

`ToolCallStream` turns the reply's text, as it arrives, into chat deltas, {"content": ...}
and OpenAI's {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}: the
id and name first, then the arguments in pieces as the model writes them. A forced reply
(tool_choice required or named) is one bare call object, held to that shape by the grammar. An
"auto" reply is text in which each <tool_call> block naming a known function becomes a call,
and so does a reply that is nothing but a call object; anything else stays text. A block holds
one call object or, in SmolLM2's format, a JSON list of them ("[]": no call), read whole once
the block closes. The non-streamed
reply is assembled from the same deltas, so the two can never disagree.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from tokenyard.gateway.edge.tool_request import ToolSetup
from tokenyard.gateway.prompt.tool_prompt import CLOSE, OPEN


# -- the reply --------------------------------------------------------------------------------
class _CallScanner:
    """Reads one call object, {"name": ..., "arguments": ...}, as its characters arrive: learns
    the name, hands out the raw text of the arguments value piece by piece."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.expect = "open"        # open, key, colon, value, comma
        self.key: str | None = None
        self.token: list[str] = []  # raw text of the depth-1 key, or of the name value
        self.name: str | None = None
        self.args: list[str] = []   # the arguments value's raw text so far
        self.args_done = False
        self.closed = False
        self.bad = False            # not a call object after all

    def feed(self, text: str) -> None:
        for ch in text:
            if self.closed or self.bad:
                return
            self._char(ch)

    def _value_char(self, ch: str) -> None:
        if self.key == "arguments":
            self.args.append(ch)
        elif self.key == "name":
            self.token.append(ch)

    def _char(self, ch: str) -> None:
        if self.expect == "open":
            if ch == "{":
                self.depth, self.expect = 1, "key"
            elif not ch.isspace():
                self.bad = True
            return
        if self.in_str:
            if self.depth > 1 or self.expect == "value":
                self._value_char(ch)
            else:
                self.token.append(ch)
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1:
                    self._end_string()
            return
        if ch == '"':
            self.in_str = True
            if self.depth > 1 or self.expect == "value":
                self._value_char(ch)
            elif self.expect == "key":
                self.token = [ch]
            else:
                self.bad = True
            return
        if self.depth > 1:
            self._value_char(ch)
            if ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._end_value()
            return
        # depth 1, outside strings: the call object's own punctuation, or a scalar value
        if ch.isspace():
            if self.expect == "value" and (self.args or self.token):
                self._end_value()
        elif ch == ":" and self.expect == "colon":
            self.expect = "value"
        elif ch == ",":
            self._end_value()
            self.expect, self.key = "key", None
        elif ch == "}":
            self._end_value()
            self.closed = True
        elif ch in "{[" and self.expect == "value":
            self._value_char(ch)
            self.depth += 1
        elif self.expect == "value":
            self._value_char(ch)       # a number, true, false or null
        else:
            self.bad = True

    def _end_string(self) -> None:
        if self.expect == "key":
            self.key = json.loads("".join(self.token))
            self.token, self.expect = [], "colon"
        elif self.expect == "value":
            self._end_value()

    def _end_value(self) -> None:
        if self.expect != "value":
            return
        if self.key == "name":
            try:
                name = json.loads("".join(self.token))
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
            self.token = []
        elif self.key == "arguments":
            self.args_done = True
        self.expect = "comma"


class ToolCallStream:
    """One choice's reply text -> chat deltas, with tool calls parsed as the text arrives."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self.mode = "call" if setup.forced else "start"   # start, text, bare, opened, call, listed, done
        self.buffer = ""          # text held back (a possible marker, a bare object, a call block)
        self.scanner = _CallScanner() if setup.forced else None
        self.calls = 1 if setup.forced else 0   # calls begun (a forced reply is one call)
        self._announced = False   # this call's id and name are out
        self._args_sent = 0       # characters of this call's arguments handed out
        self._string_args = False
        self._raw_call = ""

    @property
    def made_calls(self) -> bool:
        return self.calls > 0 and (not self.setup.forced or self._announced)

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.buffer += text
        self._advance(out, final=False)
        return out

    def close(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas, and the finish reason ("tool_calls" when the reply made calls and ended)."""
        out: list[dict[str, Any]] = []
        self._advance(out, final=True)
        if self.made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason

    # -- the state machine ----------------------------------------------------------------
    def _advance(self, out: list[dict[str, Any]], final: bool) -> None:
        while True:
            before = (self.mode, len(self.buffer))
            if self.mode == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith("{"):
                    self.mode = "bare"
                elif stripped and not OPEN.startswith(stripped[:len(OPEN)]) or final or len(stripped) >= len(OPEN):
                    self.mode = "text"
                else:
                    return
            elif self.mode == "text":
                self._text(out, final)
            elif self.mode == "bare":
                if not final:
                    return
                self._bare(out)
            elif self.mode == "opened":
                self._opened(out, final)
            elif self.mode == "listed":
                self._listed(out, final)
            elif self.mode == "call":
                self._call(out, final)
            if self.mode == "done" or (self.mode, len(self.buffer)) == before:
                return

    def _text(self, out: list[dict[str, Any]], final: bool) -> None:
        at = self.buffer.find(OPEN)
        if at >= 0 and self._may_call():
            self._content(out, self.buffer[:at])
            self.buffer = self.buffer[at + len(OPEN):]
            self.mode = "opened"
            return
        keep = 0 if final else _partial_suffix(self.buffer, OPEN)
        self._content(out, self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _bare(self, out: list[dict[str, Any]]) -> None:
        """A reply that was only an object: a call if it is one naming a known function."""
        text, self.buffer = self.buffer, ""
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if (isinstance(obj, dict) and set(obj) == {"name", "arguments"} and obj["name"] in self.setup.names()):
            args = obj["arguments"]
            args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            self.calls += 1
            out.append(self._call_delta(obj["name"], args_text, first=True))
        else:
            self._content(out, text)
        self.mode = "done"

    def _opened(self, out: list[dict[str, Any]], final: bool) -> None:
        """After <tool_call>: one call object (streamed) or a list of them (read whole)."""
        body = self.buffer.lstrip()
        if body.startswith("["):
            self.mode = "listed"
        elif body:
            self._begin_call()
        elif final:                 # the reply ended right after the tag: it was text
            self._content(out, OPEN + self.buffer)
            self.buffer = ""
            self.mode = "done"

    def _listed(self, out: list[dict[str, Any]], final: bool) -> None:
        end = self.buffer.find(CLOSE)
        if end < 0 and not final:
            return
        raw = self.buffer if end < 0 else self.buffer[:end]
        self.buffer = "" if end < 0 else self.buffer[end + len(CLOSE):]
        self.mode = "text"
        try:
            items = json.loads(raw)
        except ValueError:
            items = None
        names = self.setup.names()
        calls = [c for c in items if isinstance(c, dict) and set(c) == {"name", "arguments"} and c["name"] in names] \
            if isinstance(items, list) else []
        if not isinstance(items, list) or len(calls) != len(items):
            # Not a list of calls to known functions: what was held back is text after all.
            self._content(out, OPEN + raw + (CLOSE if end >= 0 else ""))
            return
        for c in calls[:None if self.setup.parallel else max(0, 1 - self.calls)]:
            args = c["arguments"]
            self.calls += 1
            out.append(self._call_delta(c["name"], args if isinstance(args, str) else
                                        json.dumps(args, ensure_ascii=False), first=True))

    def _begin_call(self) -> None:
        self.mode = "call"
        self.scanner = _CallScanner()
        self.calls += 1
        self._announced = False
        self._args_sent = 0
        self._string_args = False
        self._raw_call = ""

    def _call(self, out: list[dict[str, Any]], final: bool) -> None:
        sc = self.scanner
        assert sc is not None
        if self.setup.forced:
            sc.feed(self.buffer)
            self.buffer = ""
            self._emit_call(out, final)
            if sc.closed or sc.bad:
                self.mode = "done"
            return
        end = self.buffer.find(CLOSE)
        chunk = self.buffer if end < 0 else self.buffer[:end]
        keep = 0 if end >= 0 or final else _partial_suffix(chunk, CLOSE)
        chunk = chunk[:len(chunk) - keep]
        self._raw_call += chunk
        sc.feed(chunk)
        self.buffer = self.buffer[len(chunk):]
        if not self._announced and (sc.bad or (sc.name is not None and sc.name not in self.setup.names())):
            # Not a call to a known function: what was held back is text after all.
            self.calls -= 1
            self._content(out, OPEN + self._raw_call)
            self.mode = "text"
            return
        self._emit_call(out, final or end >= 0)
        if end >= 0:
            self.buffer = self.buffer[len(CLOSE):]
            self.mode = "text"

    def _emit_call(self, out: list[dict[str, Any]], final: bool) -> None:
        sc = self.scanner
        assert sc is not None
        if sc.name is None:
            return
        args = "".join(sc.args)
        if args.startswith('"'):           # arguments written as a JSON string: sent decoded, whole
            self._string_args = True
        if not self._announced:
            self._announced = True
            out.append(self._call_delta(sc.name, "", first=True))
        if self._string_args:
            if sc.args_done:
                try:
                    decoded = json.loads(args)
                except ValueError:
                    decoded = args
                if self._args_sent == 0:
                    out.append(self._call_delta(None, decoded))
                    self._args_sent = len(args)
            return
        piece = args[self._args_sent:]
        if piece:
            out.append(self._call_delta(None, piece))
            self._args_sent = len(args)

    def _call_delta(self, name: str | None, arguments: str, first: bool = False) -> dict[str, Any]:
        call: dict[str, Any] = {"index": self.calls - 1}
        if first:
            call.update(id="call_" + secrets.token_hex(12), type="function",
                        function={"name": name, "arguments": arguments})
        else:
            call["function"] = {"arguments": arguments}
        return {"tool_calls": [call]}

    def _may_call(self) -> bool:
        return self.setup.parses_calls and (self.setup.parallel or self.calls == 0)

    @staticmethod
    def _content(out: list[dict[str, Any]], text: str) -> None:
        if text:
            out.append({"content": text})


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper start of marker (held back: it may grow)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def assemble(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """A non-streamed message's content and tool_calls from a choice's deltas."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if "id" in c:
                calls[c["index"]] = {"id": c["id"], "type": "function",
                                     "function": {"name": c["function"]["name"], "arguments": ""}}
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    tool_calls = [calls[i] for i in sorted(calls)]
    return (content or None) if tool_calls else content, tool_calls
