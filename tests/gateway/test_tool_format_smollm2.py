"""SmolLM2-Instruct's own tool-calling format (issue 45.6): its template has no tools, but its model
card documents a system prompt and <tool_call>[...]</tool_call> lists; the gateway uses that format for
this model, reads such lists back as calls, and words tool results so the model answers from them."""
from __future__ import annotations

import json

import pytest

from tests.gateway.test_tool_calls import CONVERSATION, WEATHER, run
from tokenyard.engines.text.chat_template import FALLBACK_CHAT_TEMPLATE, apply_chat_template, tool_style
from tokenyard.gateway.edge.tool_request import parse_tools
from tokenyard.gateway.prompt.tool_prompt import template_messages

# SmolLM2-135M-Instruct's template, as its GGUF's tokenizer.chat_template holds it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_the_smollm2_template_gets_the_smollm2_style():
    assert tool_style(SMOLLM2_TEMPLATE) == "smollm2"
    assert tool_style(FALLBACK_CHAT_TEMPLATE) == "tags"
    assert tool_style("{% for t in tools %}{{ t }}{% endfor %}") == "template"


def test_smollm2_asks_for_calls_in_its_format_and_writes_earlier_calls_back_in_it():
    setup = parse_tools({"tools": [WEATHER]})
    follow_up = CONVERSATION + [{"role": "assistant", "content": "It is 18C and sunny."},
                                {"role": "user", "content": "And in Rome?"}]
    messages, tools = template_messages(follow_up, setup, style="smollm2")
    assert tools is None and messages[0]["role"] == "system"
    system = messages[0]["content"]
    assert system.startswith("You are an expert in composing functions.")
    listed = json.loads(system.split("<tools>")[1].split("</tools>")[0])
    assert listed == [WEATHER["function"]]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'}
    assert messages[3] == {"role": "user", "content": 'get_weather({"city": "Paris"}) returned: 18C and sunny'}
    assert messages[-1] == {"role": "user", "content": "And in Rome?"}


def test_smollm2_answering_a_tool_result_sees_it_in_plain_words_in_the_users_turn():
    # Given results as <tool_response> turns under the calling prompt, the 135M model echoed the tags.
    messages, _ = template_messages(CONVERSATION, parse_tools({"tools": [WEATHER]}), style="smollm2")
    assert messages == [{"role": "user", "content":
                         'Weather in Paris?\n\nget_weather({"city": "Paris"}) returned: 18C and sunny'}]
    text = apply_chat_template(SMOLLM2_TEMPLATE, messages)
    assert "<tool" not in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("text, calls, content", [
    ('<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n]</tool_call>',
     [("get_weather", {"city": "Paris", "days": 2})], None),
    ('<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
     '</tool_call>', [("get_time", {}), ("get_weather", {"city": "Rome"})], None),
    ("<tool_call>[]</tool_call>", [], ""),                                        # "[]": no call
    ('<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>', [],         # unknown: text
     '<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>'),
    ("Sure. <tool_call>[oops</tool_call> done", [], "Sure. <tool_call>[oops</tool_call> done"),
    ("<tool_call>", [], "<tool_call>"),                                           # nothing after the tag
])
def test_a_listed_call_block_is_read_whole_in_any_chunking(text, calls, content):
    for size in (1, 3, len(text)):
        got_content, got, finish, _ = run("auto", text, chunks=[text[i:i + size] for i in range(0, len(text), size)])
        assert [(n, json.loads(a)) for n, a in got] == calls
        assert got_content == (content if not calls else None)
        assert finish == ("tool_calls" if calls else "stop")


def test_a_listed_block_keeps_one_call_without_parallel_tool_calls():
    text = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]</tool_call>'
    _, calls, _, _ = run("auto", text, parallel=False)
    assert calls == [("get_time", "{}")]
