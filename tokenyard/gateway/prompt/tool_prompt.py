"""The prompt side of tool calls: the API's conversation and tools -> the messages (and `tools=`)
the model's chat template renders. Three styles (tokenyard.engines.text.chat_template.tool_style):

- "template": the template renders tools itself (it mentions `tools`, as Qwen2.5's and Llama 3.1's
  do): it gets them as Hugging Face passes them (`tools=`, assistant `tool_calls` with arguments as
  objects, `tool` messages).
- "smollm2": SmolLM2-Instruct, whose template has no tools but whose model card documents a format
  (its function-calling data, Synth-APIGen): a system prompt listing the functions between <tools>
  tags and asking for <tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>, a JSON list,
  "[]" for no call; earlier calls written back in that form. Tool results: the 135M model, given
  them as <tool_response> user turns, repeated the tags back as its answer (issue 45.6), so once
  the conversation ends with results (the model is to answer) they are told in plain words inside
  the user's turn, "<function>(<arguments>) returned: <result>", without the calling prompt (its
  "NO other text" would forbid the answer) and without the assistant's call turn.
- "tags": any other template: the tools described in a system preamble that asks for calls as
  <tool_call>{"name": ..., "arguments": {...}}</tool_call>, earlier calls written back in that
  form, and tool results as user messages inside <tool_response> tags.

The reply is parsed by tokenyard/gateway/http/tool_calls.py, which reads both <tool_call> forms.
"""
from __future__ import annotations

import json
from typing import Any

from tokenyard.gateway.edge.tool_request import ToolSetup

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def template_messages(messages: list[dict[str, Any]], setup: ToolSetup | None, style: str | bool
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for the template, tools= for the template) from the API's messages and tools.
    style: "template", "smollm2" or "tags" (True and False: "template" and "tags")."""
    style = {True: "template", False: "tags"}.get(style, style) if isinstance(style, bool) else style
    if style == "template":
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _as_object(
                    c["function"]["arguments"])}} for c in m["tool_calls"]]
            out.append(m)
        return out, [t.as_openai() for t in setup.tools] if setup is not None else None
    if style == "smollm2":
        return _smollm2(messages, setup), None
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
        _add_system(out, tool_preamble(setup))
    return out, None


def tool_preamble(setup: ToolSetup) -> str:
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in setup.tools)
    return ("You can call functions to help answer. These are the functions, one JSON description per line, "
            f"between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n"
            "To call a function, write one JSON object with its name and its arguments between "
            f"{OPEN} and {CLOSE}, like this:\n{OPEN}\n"
            '{"name": "function_name", "arguments": {"argument": "value"}}\n' + CLOSE)


def smollm2_preamble(setup: ToolSetup) -> str:
    """SmolLM2-Instruct's function-calling system prompt, as its model card gives it."""
    listing = json.dumps([t.as_openai()["function"] for t in setup.tools], ensure_ascii=False)
    return ("You are an expert in composing functions. You are given a question and a set of possible functions.\n"
            "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
            "If none of the functions can be used, point it out and refuse to answer.\n"
            "If the given question lacks the parameters required by the function, also point it out.\n\n"
            f"You have access to the following tools:\n<tools>{listing}</tools>\n\n"
            "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
            "The example format is as follows. Please make sure the parameter type is correct. If no function "
            "call is needed, please make the tool calls an empty list '[]'.\n"
            f"{OPEN}[\n"
            '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},\n'
            f"... (more tool calls as required)\n]{CLOSE}")


def _smollm2(messages: list[dict[str, Any]], setup: ToolSetup | None) -> list[dict[str, Any]]:
    answering = messages[-1]["role"] == "tool"
    # The calls by id, so a result can name the function and arguments it answers.
    calls = {c.get("id"): c for m in messages for c in (m.get("tool_calls") or [])}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            call = calls.get(m.get("tool_call_id"))
            said = (f"{call['function']['name']}({call['function']['arguments']}) returned: " if call
                    else "The function returned: ") + m["content"]
            last = out[-1] if out else None
            if last is not None and last["role"] == "user" and (answering or last.get("_results")):
                last["content"] += "\n\n" + said
            else:
                out.append({"role": "user", "content": said, "_results": True})
        elif m.get("tool_calls"):
            if answering and all(x["role"] == "tool" for x in messages[i + 1:]):
                continue   # the results that follow stand for it, in the user's words
            listing = ",\n".join(json.dumps(_call_text(c), ensure_ascii=False) for c in m["tool_calls"])
            out.append({"role": "assistant",
                        "content": (m["content"] + "\n" if m["content"] else "") + f"{OPEN}[\n{listing}\n]{CLOSE}"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if setup is not None and not answering:
        _add_system(out, smollm2_preamble(setup))
    return out


def _add_system(out: list[dict[str, Any]], text: str) -> None:
    if out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + text}
    else:
        out.insert(0, {"role": "system", "content": text})


def _call_text(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["function"]["name"], "arguments": _as_object(call["function"]["arguments"])}


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
