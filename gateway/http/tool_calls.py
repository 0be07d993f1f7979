"""Tool calls between the OpenAI API and the model's text.

In: the conversation, with the tools, becomes the messages the chat template renders. A template
that renders tools itself (it mentions `tools`, as Qwen2.5's and Llama 3.1's do) gets them as
Hugging Face passes them (`tools=`, assistant `tool_calls` with arguments as objects, `tool`
messages). Any other template gets the tools described in a system preamble that asks for calls
as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, earlier calls written back in
that form, and tool results as user messages inside <tool_response> tags.

Out: `ToolCallStream` turns the reply's text, as it arrives, into chat deltas, {"content": ...}
and OpenAI's {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}: the
id and name first, then the arguments in pieces as the model writes them. A forced reply
(tool_choice required or named) is one bare call object, held to that shape by the grammar. An
"auto" reply is text in which each <tool_call> block, or a reply that is nothing but a call
object, naming a known function, becomes a call; anything else stays text. The non-streamed
reply is assembled from the same deltas, so the two can never disagree.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

from gateway.http.tool_request import ToolSetup

OPEN, CLOSE = "<tool_call>", "</tool_call>"


# -- the prompt -------------------------------------------------------------------------------
def template_messages(messages: list[dict[str, Any]], setup: ToolSetup | None, renders_tools: bool
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the template, tools= for the template) from the API's messages and tools."""
    if renders_tools:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(
                    c["function"]["arguments"])}} for c in m["tool_calls"]]
            out.append(m)
        return out, [t.as_openai() for t in setup.tools] if setup is not None else None
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps(_call_text(c), ensure_ascii=False)}\n{CLOSE}"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if setup is not None:
        preamble = tool_preamble(setup)
        if out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None


def tool_preamble(setup: ToolSetup) -> str:
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in setup.tools)
    return ("You can call functions to help answer. These are the functions, one JSON description per line, "
            f"between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n"
            "To call a function, write one JSON object with its name and its arguments between "
            f"{OPEN} and {CLOSE}, like this:\n{OPEN}\n"
            '{"name": "function_name", "arguments": {"argument": "value"}}\n' + CLOSE)


def _call_text(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["function"]["name"], "arguments": _as_object(call["function"]["arguments"])}


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


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
        self.mode = "call" if setup.forced else "start"   # start, text, bare, call, done
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
            elif self.mode == "call":
                self._call(out, final)
            if self.mode == "done" or (self.mode, len(self.buffer)) == before:
                return

    def _text(self, out: list[dict[str, Any]], final: bool) -> None:
        at = self.buffer.find(OPEN)
        if at >= 0 and self._may_call():
            self._content(out, self.buffer[:at])
            self.buffer = self.buffer[at + len(OPEN):]
            self._begin_call()
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
