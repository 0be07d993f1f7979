"""tokenyard.engines.text.chat_template renders exactly what transformers' apply_chat_template renders."""
from __future__ import annotations

import datetime

import pytest
from tokenizer_factory import build_byte_level_dir, build_tiktoken_dir

from tokenyard.engines.core.errors import CheckpointError, RequestError
from tokenyard.engines.text.chat_template import (
    FALLBACK_CHAT_TEMPLATE,
    ChatTemplateError,
    apply_chat_template,
    render_chat_template,
    validate_messages,
)
from tokenyard.engines.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CHAT = [
    {"role": "system", "content": "  You are terse. Réponds en français si besoin.  "},
    {"role": "user", "content": "Hi 😀 — what's 2+2?"},
    {"role": "assistant", "content": "4\n"},
    {"role": "user", "content": "你好\n\n  and <|eot_id|> inside text"},
]
NO_SYSTEM = CHAT[1:]

# Written for these tests: block tags on their own lines (so trim_blocks / lstrip_blocks
# matter), tojson with non-ASCII text and indent, loop controls, namespace, tools, a
# {% generation %} block, dict.get, slicing, and raise_exception.
RICH_TEMPLATE = """{%- set ns = namespace(count=0) %}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = "Défaut ✓" %}
    {% set rest = messages %}
{% endif %}
{{ bos_token }}<system>
{{ system | trim }}
{% if tools is not none %}
Tools: {{ tools | tojson(indent=2) }}
{% endif %}
</system>
{% for m in rest %}
    {% if loop.index > 6 %}{% break %}{% endif %}
    {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    <{{ m['role'] }}>
    {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}
    {% else %}{{ m['content'] }}{% endif %}
    </{{ m['role'] }}>
    {% if m.get('meta') %}
    meta={{ m['meta'] | tojson }}
    {% endif %}
{% endfor %}
turns={{ ns.count }}
{% if add_generation_prompt %}
<assistant>
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Weather ☀️",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {
        "byte_level": build_byte_level_dir(root / "byte_level"),
        "tiktoken": build_tiktoken_dir(root / "tiktoken"),
        "no_template": build_byte_level_dir(root / "no_template", chat_template=None),
    }


@pytest.fixture(scope="session")
def pairs(folders):
    return {name: (Tokenizer.from_dir(p), transformers.AutoTokenizer.from_pretrained(str(p)))
            for name, p in folders.items()}


def _ids(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("kind", ["byte_level", "tiktoken"])
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CHAT, NO_SYSTEM, CHAT[:1]])
def test_llama3_template_matches_transformers(pairs, kind, generation_prompt, messages):
    ours, theirs = pairs[kind]
    text = apply_chat_template(ours, messages, add_generation_prompt=generation_prompt)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    ids = apply_chat_template(ours, messages, add_generation_prompt=generation_prompt, tokenize=True)
    assert ids == _ids(theirs.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True))
    assert ids.count(ours.bos_token_id) == 1  # the template writes BOS; encoding must not add another


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_fallback_template_is_chatml_and_matches_transformers(pairs, generation_prompt):
    ours, theirs = pairs["no_template"]
    assert ours.chat_template is None
    text = apply_chat_template(ours, NO_SYSTEM[:2], add_generation_prompt=generation_prompt)
    expected = "<|im_start|>user\nHi 😀 — what's 2+2?<|im_end|>\n<|im_start|>assistant\n4\n<|im_end|>\n"
    assert text == expected + ("<|im_start|>assistant\n" if generation_prompt else "")
    assert text == theirs.apply_chat_template(NO_SYSTEM[:2], chat_template=FALLBACK_CHAT_TEMPLATE,
                                              add_generation_prompt=generation_prompt, tokenize=False)


@pytest.mark.parametrize("messages", [CHAT, NO_SYSTEM,
                                      NO_SYSTEM[:1] + [{"role": "assistant", "content": " ok ", "meta": {"é": [1, "ü"]}}]])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rich_template_matches_transformers(pairs, messages, tools, generation_prompt):
    ours, theirs = pairs["byte_level"]
    got = apply_chat_template(RICH_TEMPLATE, messages, add_generation_prompt=generation_prompt, tools=tools,
                              bos_token=ours.bos_token, eos_token=ours.eos_token)
    want = theirs.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tools=tools,
                                      add_generation_prompt=generation_prompt, tokenize=False)
    assert got == want
    if tools:
        assert '"météo"' in got and "☀️" in got  # tojson keeps non-ASCII, as HF's does


def test_tokenizer_template_is_used_with_tokenizer_specials(pairs):
    ours, _ = pairs["byte_level"]
    assert apply_chat_template(ours, CHAT).startswith("<|begin_of_text|><|start_header_id|>system")


def test_raise_exception_is_a_typed_request_error(pairs):
    ours, theirs = pairs["byte_level"]
    bad = [{"role": "assistant", "content": "first"}, {"role": "user", "content": "second"}]
    with pytest.raises(ChatTemplateError, match="alternate") as info:
        apply_chat_template(RICH_TEMPLATE, bad)
    assert isinstance(info.value, RequestError)
    with pytest.raises(Exception, match="alternate"):  # transformers refuses it too
        theirs.apply_chat_template(bad, chat_template=RICH_TEMPLATE, tokenize=False)


@pytest.mark.parametrize("messages", [
    [], "hello", None, [["user", "hi"]], [{"role": "wizard", "content": "hi"}], [{"content": "hi"}],
    [{"role": "user", "content": None}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": "ok"}, {"role": "user"}],
])
def test_invalid_messages_are_request_errors(messages):
    with pytest.raises(RequestError):
        apply_chat_template(FALLBACK_CHAT_TEMPLATE, messages)


def test_every_known_role_is_accepted():
    roles = ["system", "developer", "user", "assistant", "tool"]
    messages = validate_messages([{"role": r, "content": r, "tool_call_id": "x"} for r in roles])
    assert render_chat_template(FALLBACK_CHAT_TEMPLATE, messages, add_generation_prompt=False).count("<|im_start|>") == 5


@pytest.mark.parametrize("template", [
    "{{ messages.append({'role': 'user'}) }}",             # the environment is immutable
    "{{ messages[0].update({'content': 'x'}) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",       # and sandboxed
    "{{ messages[5]['content'] }}",
])
def test_sandbox_and_render_failures_are_chat_template_errors(template):
    with pytest.raises(ChatTemplateError):
        render_chat_template(template, NO_SYSTEM)


def test_broken_template_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="does not compile"):
        render_chat_template("{% for m in messages %}{{ m }}", NO_SYSTEM)


def test_strftime_now_and_undefined_specials():
    year = str(datetime.datetime.now().year)
    assert render_chat_template("{{ strftime_now('%Y') }}", NO_SYSTEM) == year
    # Like HF, a special token the tokenizer lacks is undefined and renders as nothing.
    assert render_chat_template("[{{ bos_token }}]", NO_SYSTEM) == "[]"


def test_tokenize_needs_a_tokenizer():
    with pytest.raises(ValueError):
        apply_chat_template(FALLBACK_CHAT_TEMPLATE, NO_SYSTEM, tokenize=True)
