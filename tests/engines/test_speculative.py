"""Speculative decoding: greedy output unchanged, sampled output distributed as the target's,
exact rollback (all blocks free, in both caches), abort mid-speculation."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from tests.engine_helpers import prompt_logits, random_prompts, run_to_completion
from tokenyard.bench.random_checkpoint import build_random_checkpoint
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.speculative import spec_acceptance

BASE = dict(dtype="float32", progress=False, max_num_batched_tokens=48, kv_cache_memory=3 << 20)


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so prompt lookup has something to propose."""
    out = []
    for i, p in enumerate(random_prompts(n, 4, 12, 512, seed=seed)):
        out.append(p * (2 + i % 3) + p[: 1 + i % len(p)])
    return out


def _run(path, prompts, params, stagger=True, **opts) -> tuple[dict, Engine]:
    eng = Engine(path, **{**BASE, **opts})
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        eng.add_request(f"r{i}", p, params[i], priority=i % 2)
    outs: dict[str, list[int]] = {}
    if stagger:
        for _ in range(3):  # later arrivals land mid-prefill and mid-speculation
            for out in eng.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, p in enumerate(prompts[half:], start=half):
        eng.add_request(f"r{i}", p, params[i], priority=i % 2)
    for rid, toks in run_to_completion(eng).items():
        outs.setdefault(rid, []).extend(toks)
    return outs, eng


@pytest.mark.parametrize("method", ["ngram", "draft-same", "draft-other"])
def test_greedy_output_identical(checkpoint_dir, method):
    target = checkpoint_dir("llama")
    shared = random_prompts(1, 20, 20, 512, seed=5)[0]  # a shared 20-token prefix: prefix-cache hits
    prompts = _repetitive_prompts(6, seed=3) + [shared + p for p in random_prompts(4, 3, 30, 512, seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 4), ignore_eos=i % 3 != 0,
                             stop_token_ids=[7] if i == 4 else []) for i in range(len(prompts))]
    spec = dict(speculative_method="ngram" if method == "ngram" else "draft", num_speculative_tokens=3,
                spec_max_batch=64)
    if method == "draft-same":
        spec["draft_model"] = str(target)              # every draft accepted: the bonus-token path
    elif method == "draft-other":
        spec["draft_model"] = str(checkpoint_dir("llama_mha"))  # mostly rejected: the resample path
    ref, plain = _run(target, prompts, params)
    got, eng = _run(target, prompts, params, **spec)
    # Prefix sharing and block pressure (3 MiB of KV for 10 requests) really happened.
    assert eng.blocks.hit_tokens > 0
    assert got == ref
    st = eng.stats()
    assert st.spec_num_proposed > 0
    if method == "draft-same":
        assert st.spec_acceptance_rate > 0.95
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    if method != "ngram":
        draft = eng.spec.proposer
        assert draft.num_free_blocks == draft.blocks.num_blocks and not draft._states


def test_preemption_under_speculation(checkpoint_dir):
    target = checkpoint_dir("llama")
    prompts = _repetitive_prompts(8, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(prompts)
    opts = dict(kv_cache_memory=160 << 10)  # few blocks: running sequences get preempted
    ref, _ = _run(target, prompts, params, **opts)
    got, eng = _run(target, prompts, params, speculative_method="draft", draft_model=str(target),
                    spec_max_batch=64, **opts)
    assert eng.scheduler.num_preemptions > 0
    assert got == ref
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.spec.proposer.num_free_blocks == eng.spec.proposer.blocks.num_blocks


def test_abort_mid_speculation_frees_everything(checkpoint_dir):
    target = checkpoint_dir("llama")
    eng = Engine(target, **BASE, speculative_method="draft", draft_model=str(checkpoint_dir("llama_mha")),
                 spec_max_batch=64)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(_repetitive_prompts(4, seed=11)):
        eng.add_request(f"r{i}", p, params)
    for _ in range(6):
        eng.step()
    assert eng.stats().spec_num_proposed > 0
    eng.abort("r1")
    eng.abort("r2")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["r1"].finish_reason == "abort" and outs["r2"].finish_reason == "abort"
    for rid in ("r0", "r3"):
        eng.abort(rid)
    eng.step()
    assert not eng.has_unfinished()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert eng.spec.proposer.num_free_blocks == eng.spec.proposer.blocks.num_blocks


# ------------------------------------------------------------------------------------------
# The distribution test: a vocabulary of 8 tokens, thousands of seeded samples.

VOCAB = 8
N_SAMPLES = 3000


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    # Large init std: peaked distributions that differ between the two models, so a wrong rule
    # (one that lets the draft's distribution through) shows up clearly.
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=7, pad_token_id=0, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    target = build_random_checkpoint(root / "target", "llama", seed=4, std=0.6, **common)
    draft = build_random_checkpoint(root / "draft", "llama", seed=9, std=0.6, **common)
    return target, draft


def _exact_distributions(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact target distributions of (t0, t1) jointly [V, V] and of t2 [V] at temperature 1."""
    eng = Engine(target, **{**BASE, "kv_cache_memory": 1 << 20})
    p0 = torch.softmax(prompt_logits(eng, prompt)[-1], -1)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p2 = torch.zeros(VOCAB, dtype=torch.float64)
    for a in range(VOCAB):
        p1 = torch.softmax(prompt_logits(eng, prompt + [a])[-1], -1).double()
        joint[a] = p0[a].double() * p1
        for b in range(VOCAB):
            p2 += joint[a, b] * torch.softmax(prompt_logits(eng, prompt + [a, b])[-1], -1).double()
    return joint, p2


def _gof(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value, pooling cells expected below 5."""
    probs = probs.flatten().double()
    expected = probs / probs.sum() * float(counts.sum())
    observed = counts.flatten().double()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]) if small.any() else observed
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _sample_counts(target, draft, method: str, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, Engine]:
    eng = Engine(target, **{**BASE, "kv_cache_memory": 16 << 20, "max_num_batched_tokens": 2048,
                            "max_num_seqs": 512}, speculative_method=method,
                 draft_model=str(draft) if method == "draft" else None, num_speculative_tokens=3,
                 spec_max_batch=1024, ngram_min=1, ngram_max=2)
    for i in range(N_SAMPLES):
        eng.add_request(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True))
    outs = run_to_completion(eng)
    joint = torch.zeros(VOCAB, VOCAB)
    third = torch.zeros(VOCAB)
    for toks in outs.values():
        joint[toks[0], toks[1]] += 1
        third[toks[2]] += 1
    return joint, third, eng


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_tokens_follow_target_distribution(tiny_pair, method, monkeypatch):
    target, draft = tiny_pair
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup proposes from the first token on
    exact_joint, exact_third = _exact_distributions(target, prompt)
    joint, third, eng = _sample_counts(target, draft, method, prompt)
    st = eng.stats()
    assert st.spec_num_proposed > N_SAMPLES // 2 and 0.05 < st.spec_acceptance_rate < 0.95  # both paths exercised
    assert _gof(joint, exact_joint) > 1e-3
    assert _gof(third, exact_third) > 1e-3

    # The same test rejects a wrong rule: accepting every draft lets the proposer's distribution through.
    def accept_all(target_probs, drafts, draft_probs, seed, index):
        return list(drafts) + [int(torch.multinomial(target_probs[len(drafts)], 1))]

    monkeypatch.setattr(spec_acceptance, "accept_sampled", accept_all)
    joint, third, _ = _sample_counts(target, draft, method, prompt)
    assert min(_gof(joint, exact_joint), _gof(third, exact_third)) < 1e-6


def test_speculation_turns_off_past_spec_max_batch(checkpoint_dir):
    """With more decoding sequences than spec_max_batch, steps run without speculation; once the
    batch shrinks back, speculation resumes."""
    eng = Engine(checkpoint_dir("llama"), **BASE, speculative_method="ngram", spec_max_batch=1)
    prompts = _repetitive_prompts(3, seed=13)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=4 + 12 * (i == 0), ignore_eos=True))
    while len(eng.scheduler.running) < 3 or any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running):
        eng.step()
    eng.step()
    assert eng.spec.stats.num_skipped_steps >= 1 and eng.spec.stats.num_proposed == 0
    run_to_completion(eng)  # r0 decodes alone at the end: speculation is back on
    assert eng.spec.stats.num_proposed > 0
