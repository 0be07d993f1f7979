"""tokenyard.engines.text.tokenizer against transformers on tokenizers built here (no downloads).

Three formats: Llama-3 style tokenizer.json (byte-level BPE), the same vocabulary as a
tiktoken-format tokenizer.model (transformers 5 converts it, so it is compared with
transformers too), and Llama-2 / Mistral style tokenizer.json (metaspace + <0xNN> fallback).
"""
from __future__ import annotations

import json
import shutil
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_factory import (
    LLAMA3_SPECIALS,
    build_byte_fallback_dir,
    build_byte_level_dir,
    build_sentencepiece_only_dir,
    build_tiktoken_dir,
    byte_level_alphabet,
)

from tokenyard.engines.core.errors import CheckpointError, RequestError
from tokenyard.engines.text.byte_level import byte_level_table
from tokenyard.engines.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # the tiktoken file first fails as SentencePiece, loudly

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we've 3,141 apples!",
    "你好，世界。今天天气很好",
    "こんにちは世界 안녕하세요 Привет мир العربية",
    "emoji 😀😃 🎉 👍🏽 👨‍👩‍👧‍👦 ❤️ 🚀",
    "    leading spaces, trailing spaces    ",
    "tabs\t\tand\nnew\n\n\nlines\r\n\r\nend",
    "runs     of      spaces  ",
    "digits 0 12 345 6789 1234567890 3.14159 1e-9 0xFF",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": None}  # comment\n",
    "I'LL say THEY'RE fine, isn't it? You'Ve done",
    "Math ∑ x² ≈ π ≠ ∞; combining é (e\u0301) and ZWJ",
    "<|begin_of_text|>Hello<|eot_id|>",
    "a<|eot_id|>b <|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|eot_id|><|eot_id|> partial <|eot_id and <|eot_id|",
    "<s> Llama-2 style </s> specials <unk>",
    "▁ the metaspace char itself ▁▁",
]


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "byte_level": build_byte_level_dir(root / "byte_level"),
        "tiktoken": build_tiktoken_dir(root / "tiktoken"),
        "byte_fallback": build_byte_fallback_dir(root / "byte_fallback"),
        "metaspace": build_byte_fallback_dir(root / "metaspace", metaspace_decoder=True),
    }


@pytest.fixture(scope="session")
def ours(dirs):
    return {name: Tokenizer.from_dir(path) for name, path in dirs.items()}


@pytest.fixture(scope="session")
def theirs(dirs):
    return {name: transformers.AutoTokenizer.from_pretrained(str(path)) for name, path in dirs.items()}


KINDS = ["byte_level", "tiktoken", "byte_fallback", "metaspace"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, theirs, kind, add_special_tokens):
    for text in TEXTS:
        expected = theirs[kind].encode(text, add_special_tokens=add_special_tokens)
        assert ours[kind].encode(text, add_special_tokens=add_special_tokens) == expected, text
        assert ours[kind].count_tokens(text, add_special_tokens=add_special_tokens) == len(expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, theirs, kind, skip):
    for text in TEXTS:
        ids = theirs[kind].encode(text)
        assert ours[kind].decode(ids, skip_special_tokens=skip) == theirs[kind].decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", ["byte_level", "tiktoken"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_random_text_matches_transformers_and_round_trips(ours, theirs, kind, text):
    ids = ours[kind].encode(text, add_special_tokens=False)
    assert ids == theirs[kind].encode(text, add_special_tokens=False)
    assert ours[kind].decode(ids) == text  # byte-level BPE is lossless


def test_tiktoken_and_tokenizer_json_agree_on_the_same_vocabulary(ours):
    # Hand-checked special-token case: the tiktoken path recognises specials literally and gives
    # them the ids from added_tokens_decoder (appended after the 700-rank base vocabulary).
    tt = ours["tiktoken"]
    ids = tt.encode("x<|eot_id|>", add_special_tokens=True)
    assert ids[0] == 700 and ids[-1] == 705 and tt.decode(ids[1:-1]) == "x"
    for text in TEXTS:
        assert tt.encode(text) == ours["byte_level"].encode(text), text


def test_special_token_properties(ours):
    bl, tt, bf = ours["byte_level"], ours["tiktoken"], ours["byte_fallback"]
    assert (bl.bos_token, bl.bos_token_id, bl.eos_token, bl.eos_token_id) == ("<|begin_of_text|>", 700, "<|eot_id|>", 705)
    assert bl.eos_token_ids == (705, 701)  # tokenizer_config's first, then generation_config's
    assert bl.all_special_ids == list(range(700, 706)) == tt.all_special_ids
    assert bl.vocab_size == tt.vocab_size == 706
    assert (tt.bos_token_id, tt.eos_token_ids) == (700, (705,))  # eos_token given as an AddedToken dict
    assert (bf.bos_token_id, bf.eos_token_ids, bf.all_special_ids) == (1, (2,), [0, 1, 2])
    assert bf.strips_leading_space and ours["metaspace"].strips_leading_space
    assert not bl.strips_leading_space and not tt.strips_leading_space
    assert bl.token_to_id("<|eot_id|>") == tt.token_to_id("<|eot_id|>") == 705
    assert tt.token_to_id("a") == bl.token_to_id("a") is not None
    assert bl.is_special(700) and not bl.is_special(5)


@pytest.mark.parametrize("kind", KINDS)
def test_id_to_bytes_concatenates_to_decode(ours, kind):
    tok = ours[kind]
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            raw = b"".join(tok.id_to_bytes(i) for i in ids if not (skip and tok.is_special(i)))
            if tok.strips_leading_space and raw.startswith(b" "):
                raw = raw[1:]
            assert raw.decode("utf-8", errors="replace") == tok.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("kind", KINDS)
def test_id_to_bytes_for_every_token(ours, kind):
    tok = ours[kind]
    for i in range(tok.vocab_size):
        raw = tok.id_to_bytes(i)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a piece of a character; covered by the concatenation test
        if tok.strips_leading_space and text.startswith(" "):
            text = text[1:]
        assert tok.decode([i]) == text, i
    assert tok.id_to_bytes(10**6) == b"" and tok.decode([10**6]) == ""


def test_byte_level_table_is_gpt2s():
    assert byte_level_table() == {ch: b for b, ch in byte_level_alphabet().items()}
    from tokenizers.pre_tokenizers import ByteLevel
    assert set(byte_level_table()) == set(ByteLevel.alphabet())


@pytest.mark.parametrize("flag", [True, False])
def test_tokenizer_json_post_processor_decides_bos_like_transformers(tmp_path, flag):
    # transformers 5 keeps tokenizer.json's post-processor even when tokenizer_config.json
    # sets add_bos_token / add_eos_token, and so do we.
    path = build_byte_level_dir(tmp_path / "tok")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = flag
    config["add_eos_token"] = not flag
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    assert ours.encode("hi")[0] == 700 and ours.encode("hi")[-1] != 705


@pytest.mark.parametrize("add_bos,add_eos", [(False, False), (True, True), (False, True)])
def test_tiktoken_add_bos_and_eos_tokens_like_transformers(tmp_path, add_bos, add_eos):
    path = build_tiktoken_dir(tmp_path / "tok", add_bos_token=add_bos)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["add_eos_token"] = add_eos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    ids = ours.encode("hi")
    assert (ids[0] == 700) is add_bos and (ids[-1] == 705) is add_eos


def test_tiktoken_pattern_from_config(tmp_path):
    path = build_tiktoken_dir(tmp_path / "tok")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["pat_str"] = r"\S+|\s+"  # whitespace split only: "it's" stays one pre-token
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(path)
    assert tok.decode(tok.encode("it's 123456")) == "<|begin_of_text|>it's 123456"
    assert "<|begin_of_text|>" in tok.decode(tok.encode("x"))


def test_chat_template_sources(tmp_path, ours):
    assert ours["byte_level"].chat_template.startswith("{% set loop_messages")
    assert ours["byte_fallback"].chat_template is None
    in_file = Tokenizer.from_dir(build_byte_level_dir(tmp_path / "file", chat_template="{{ 'x' }}", template_file=True))
    assert in_file.chat_template == "{{ 'x' }}"
    named = build_byte_level_dir(tmp_path / "named", chat_template=None)
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(named).chat_template == "D"


def test_sentencepiece_only_folder_names_tokenizer_json(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(build_sentencepiece_only_dir(tmp_path / "sp"))


def test_bad_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="not a folder"):
        Tokenizer.from_dir(tmp_path / "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_dir(broken)
    bad_lines = build_tiktoken_dir(tmp_path / "bad_lines")
    with (bad_lines / "tokenizer.model").open("a") as f:
        f.write("!!notbase64 12\n")
    with pytest.raises(CheckpointError, match="base64"):
        Tokenizer.from_dir(bad_lines)
    bad_config = build_tiktoken_dir(tmp_path / "bad_config")
    (bad_config / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        Tokenizer.from_dir(bad_config)


def test_encode_rejects_non_text(ours):
    with pytest.raises(RequestError):
        ours["byte_level"].encode(["not", "text"])


def test_loads_fast_and_without_weights(dirs, tmp_path):
    for path in dirs.values():
        copy = shutil.copytree(path, tmp_path / path.name)
        assert not list(copy.glob("*.safetensors"))
        start = time.perf_counter()
        Tokenizer.from_dir(copy)
        assert time.perf_counter() - start < 1.0


def test_specials_follow_the_llama3_layout(dirs):
    config = json.loads((dirs["tiktoken"] / "tokenizer_config.json").read_text())
    assert [v["content"] for v in config["added_tokens_decoder"].values()] == LLAMA3_SPECIALS
