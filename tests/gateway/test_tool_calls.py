"""Tool calls without a model: parsing the request's tools, the prompt the template gets, and the
reply text -> content and tool-call deltas, streamed in any chunking and assembled alike."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenyard.engines.text.chat_template import FALLBACK_CHAT_TEMPLATE, apply_chat_template, renders_tools
from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.edge.tool_request import parse_tools
from tokenyard.gateway.http.tool_calls import ToolCallStream, assemble
from tokenyard.gateway.prompt.tool_prompt import template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def run(choice, text, chunks=None, finish="stop", parallel=None):
    body = {"tools": [WEATHER, TIME], "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    stream = ToolCallStream(parse_tools(body))
    deltas = []
    pieces = chunks if chunks is not None else [text]
    for piece in pieces:
        deltas += stream.feed(piece)
    more, finish = stream.close(finish)
    content, calls = assemble(deltas + more)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], finish, deltas + more


def test_forced_call_streams_id_and_name_first_then_arguments_in_pieces():
    text = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris"}}'
    content, calls, finish, deltas = run("required", text, chunks=[text[i:i + 4] for i in range(0, len(text), 4)])
    assert content is None and finish == "tool_calls"
    assert calls == [("get_weather", '{"city": "Pa\\"ris"}')] and json.loads(calls[0][1]) == {"city": 'Pa"ris'}
    first = deltas[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) > 3 and all("id" not in d["tool_calls"][0] for d in deltas[1:])


def test_forced_call_cut_by_max_tokens_is_length_with_partial_arguments():
    content, calls, finish, _ = run("required", '{"name": "get_weather", "arguments": {"ci', finish="length")
    assert finish == "length" and calls == [("get_weather", '{"ci')]


def test_auto_parses_tagged_calls_and_keeps_the_text_around_them():
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls, finish, _ = run("auto", text)
    assert content == "Let me look. " and finish == "tool_calls"
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def test_parallel_tool_calls_false_keeps_one_call():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    _, calls, _, _ = run("auto", text, parallel=False)
    assert calls == [("get_time", "{}")]


@pytest.mark.parametrize("text, calls", [
    ('  {"name": "get_time", "arguments": {}}', [("get_time", "{}")]),             # a bare call object
    ('{"name": "get_time", "arguments": "{\\"tz\\": 1}"}', [("get_time", '{"tz": 1}')]),   # arguments as a string
    ('{"answer": 42}', []),                                                     # JSON, but not a call
    ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', []),  # unknown function: text
    ('Use <tool_c as a tag, or <tool_call> alone', []),                         # marker prefixes: text
])
def test_auto_replies_that_are_and_are_not_calls(text, calls):
    content, got, finish, _ = run("auto", text)
    assert got == calls
    if not calls:
        assert content == text and finish == "stop"


def test_none_never_parses_calls():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls, finish, _ = run("none", text)
    assert content == text and calls == [] and finish == "stop"


REPLIES = [
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "O\'Hare \\u00e9"}}</tool_call> ok',
    '{"name": "get_time", "arguments": {"nested": {"a": [1, {"b": "}"}]}}}',
    'plain text with < and <tool and {braces}',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "</tool"}}</tool_call>',
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(1, 7), min_size=1, max_size=40))
def test_any_chunking_gives_the_reply_whole_text_gives(text, sizes):
    chunks, i = [], 0
    for size in sizes:
        chunks.append(text[i:i + size])
        i += size
    chunks.append(text[i:])
    whole = run("auto", text)
    streamed = run("auto", text, chunks=chunks)
    assert streamed[:3] == whole[:3]


@pytest.mark.parametrize("body, param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_are_400_naming_the_parameter(body, param):
    with pytest.raises(BadRequest) as e:
        parse_tools(body)
    assert e.value.param == param


def test_named_choice_constrains_to_that_function_and_required_to_any():
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    schema = named.constraint()["schema"]
    assert schema["properties"]["name"] == {"const": "get_time"}
    anyof = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).constraint()["schema"]["anyOf"]
    assert [s["properties"]["name"]["const"] for s in anyof] == ["get_weather", "get_time"]
    assert parse_tools({"tools": [WEATHER]}).constraint() is None      # auto: free text


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "18C and sunny", "tool_call_id": "call_1"},
]


def test_a_template_without_tools_gets_a_preamble_and_tagged_history():
    setup = parse_tools({"tools": [WEATHER]})
    assert not renders_tools(FALLBACK_CHAT_TEMPLATE)
    messages, tools = template_messages(CONVERSATION, setup, style="tags")
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18C and sunny\n</tool_response>"}
    text = apply_chat_template(FALLBACK_CHAT_TEMPLATE, messages)
    assert "18C and sunny" in text and text.endswith("<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them_as_hugging_face_passes_them():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
                "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% else %}{{ m.content }}{% endif %};"
                "{% endfor %}")
    assert renders_tools(template)
    messages, tools = template_messages(CONVERSATION, parse_tools({"tools": [WEATHER]}), style="template")
    assert apply_chat_template(template, messages, tools=tools) == \
        "[get_weather]user:Weather in Paris?;assistant:Paris;tool:18C and sunny;"


def test_a_bare_call_with_arguments_hands_them_on_as_json():
    # Arguments with a string, a number, a bool, null and a nested list: written with str() they
    # would be a Python repr ("{'city': 'Paris', ...}"), which json.loads refuses (issue 45.12).
    args = {"city": "Paris", "days": 3, "metric": True, "note": None, "tags": ["a", "é"]}
    content, calls, finish, _ = run("auto", json.dumps({"name": "get_weather", "arguments": args}))
    assert content is None and finish == "tool_calls"
    ((name, arguments),) = calls
    assert name == "get_weather" and json.loads(arguments) == args
