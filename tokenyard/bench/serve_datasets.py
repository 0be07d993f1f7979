"""Request sets for the serving benchmark, seeded so every server sees the same requests.

- `random_lengths`: W2-like (issue 2): prompt and output lengths uniform over ranges. Prompts
  are random words cut to the wanted token count with the server's tokenizer, so lengths are
  controlled in tokens while the text stays valid for any tokenizer. The chat template adds a
  few tokens on top (the server's usage reports the exact count).
- `task_suite`: the demo task suite's test split, each request carrying its item so the
  returned text can be checked (accuracy).
- `shared_prefix_chat`: a few long system prompts shared by many short user turns, the shape
  prefix caching is for.
- `summarisation_mix`: mostly long documents to summarise plus some short questions: prefill
  heavy, the shape that stresses chunked prefill and TTFT under load.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

from tokenyard.bench.load_generator import ChatRequest

# Plain words every tokenizer in the project can encode (the demo suite's vocabulary is a superset).
_FALLBACK_WORDS = ("red sun blue sky green tree river stone cloud paper window garden market story "
                   "music silver winter summer bright quiet gentle rapid simple yellow orange purple "
                   "table chair letter number city road house light water forest ocean island").split()


def word_pool() -> list[str]:
    try:
        from tokenyard.demo.task_suite import WORDS
        return list(WORDS) + _FALLBACK_WORDS
    except ImportError:  # bench/ should not depend on demo/ for plain words
        return list(_FALLBACK_WORDS)


class TokenSizer:
    """Cuts text to a token count with one tokenizer (the serving model's)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenyard.engines.text.tokenizer import Tokenizer
        self.tokenizer = Tokenizer.from_dir(model_dir)

    def text_of(self, n_tokens: int, rng: random.Random, words: Sequence[str]) -> str:
        """Random words whose encoding is about n_tokens tokens (exact up to re-tokenisation at
        the cut, usually +-1). One encode per call: draw plenty of words, cut the ids, decode."""
        text = " ".join(rng.choice(words) for _ in range(n_tokens + 8))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < n_tokens:               # words of one token each: draw more
            text += " " + " ".join(rng.choice(words) for _ in range(n_tokens))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids[:n_tokens]).strip()

    def count(self, text: str) -> int:
        return self.tokenizer.count_tokens(text)


def random_lengths(n: int, sizer: TokenSizer, input_range: tuple[int, int] = (32, 512),
                   output_range: tuple[int, int] = (16, 256), max_model_len: int | None = None,
                   seed: int = 0, template_margin: int = 16) -> list[ChatRequest]:
    """W2's length distribution over HTTP. With max_model_len, output lengths are cut so that
    prompt + template + output fits (the demo models have a 512-token context)."""
    rng = random.Random(seed)
    words = word_pool()
    out: list[ChatRequest] = []
    for i in range(n):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        if max_model_len is not None:
            n_in = min(n_in, max_model_len - template_margin - 1)
            n_out = max(1, min(n_out, max_model_len - n_in - template_margin))
        out.append(ChatRequest([{"role": "user", "content": sizer.text_of(n_in, rng, words)}], n_out,
                               tag=f"in{n_in}-out{n_out}"))
    return out


def task_suite(n: int, seed: int = 0, split: str = "test", max_tokens: int = 48) -> list[ChatRequest]:
    """Task-suite items; each request's `check` is its TaskItem (item.check(reply) -> bool)."""
    from tokenyard.demo.task_suite import generate_items
    items = generate_items(split, n, seed=seed)
    return [ChatRequest([dict(m) for m in item.messages], max_tokens, tag=f"{item.task}/L{item.level}", check=item)
            for item in items]


def shared_prefix_chat(n: int, sizer: TokenSizer, system_tokens: int = 256, num_prefixes: int = 2,
                       user_tokens: tuple[int, int] = (8, 24), output_tokens: int = 32,
                       seed: int = 0) -> list[ChatRequest]:
    """n short user turns, each behind one of `num_prefixes` long system prompts (round robin, so
    every prefix is seen early and then reused). Its usage's cached_tokens shows the reuse."""
    rng = random.Random(seed)
    words = word_pool()
    systems = [f"You are assistant number {k}. " + sizer.text_of(system_tokens, rng, words)
               for k in range(num_prefixes)]
    return [ChatRequest([{"role": "system", "content": systems[i % num_prefixes]},
                         {"role": "user", "content": sizer.text_of(rng.randint(*user_tokens), rng, words)}],
                        output_tokens, tag=f"prefix{i % num_prefixes}")
            for i in range(n)]


def summarisation_mix(n: int, sizer: TokenSizer, long_fraction: float = 0.7,
                      long_tokens: tuple[int, int] = (1024, 2048), short_tokens: tuple[int, int] = (16, 64),
                      output_tokens: tuple[int, int] = (32, 96), max_model_len: int | None = None,
                      seed: int = 0, template_margin: int = 32) -> list[ChatRequest]:
    """Long documents to summarise (`long_fraction` of them) mixed with short questions."""
    rng = random.Random(seed)
    words = word_pool()
    out: list[ChatRequest] = []
    for _ in range(n):
        is_long = rng.random() < long_fraction
        n_in = rng.randint(*(long_tokens if is_long else short_tokens))
        n_out = rng.randint(*output_tokens)
        if max_model_len is not None:
            n_out = min(n_out, max(1, max_model_len // 4))
            n_in = max(1, min(n_in, max_model_len - n_out - template_margin))
        body = sizer.text_of(n_in, rng, words)
        content = f"Summarise the text below in one sentence.\n\n{body}" if is_long else body
        out.append(ChatRequest([{"role": "user", "content": content}], n_out,
                               tag="long" if is_long else "short"))
    return out


def max_model_len_of(model_dir: str | Path) -> int | None:
    """The checkpoint's max_position_embeddings (None when the folder has no config.json)."""
    import json
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("max_position_embeddings")
