"""Issue 51 item 2, second round: feature designs tried against new wording, each retrained and measured.

    .venv/bin/python -m tokenyard.bench.router_feature_trials [--trials base,intent_token,...]
        [--wordnet /usr/share/wordnet] [--no-results | --results-name router_feature_trials]

Every trial retrains the router with the shipped recipe (tokenyard router train: feature version 3,
two augmented copies, C 1, 30% large calls calibrated on the calibration split) and changes one
thing. Each is measured twice:

  dev    what choices were made on; no benchmark grammar in it: the calibration split scored as
         written and as one perturbed copy (training/augment.py, seed 7, not the training seed 0),
         APGR of both and the agreement of their decisions; and APGR on the calibration split's
         phrasing-3 prompts (the suite's held-out wording, never in train).
  bench  the rewording benchmark (router_rewording, seed 0), no bootstrap: per wording APGR, its
         drop from the familiar wording, decision agreement, CPT(95%). Reported, never tuned on.

Trials:
  base             the shipped recipe (must equal bench/results/router_rewording.json)
  intent_token     a task-intent classifier (multinomial logistic regression over the normalised
                   instruction words, their character 3-5-grams and the payload's kind, trained on
                   train + its augmented copies, task labels from the suite) adds its top intent
                   and a confidence bucket as instruction words, so the size crosses see them
  intent_replace   an instruction with a word training never used is replaced by the predicted
                   intent's phrasing-0 instruction words (when the intent's probability >= 0.5)
  wordnet_all / wordnet_verbs
                   an unknown instruction word (after the typo repair) is mapped to the training
                   instruction word it shares the most WordNet 3.0 synsets with (all parts of speech
                   / verbs only), instead of being dropped; the map is derived mechanically from
                   WordNet's data files for every training instruction word (frequency >= 20), no
                   word picked by hand; skipped when the data files are absent
  engine_hidden    demo-small's own view of the prompt: a prefill (chat template, fp32,
                   transformers) and its final layer's mean-pooled hidden state, layer 2's mean, and
                   the last token's final hidden state (384 values), standardised, appended to the text
                   features (weight 1 and 3), and alone; its prefill cost reported separately
  layout_calibration
                   the base model with one threshold per layout class of the request's last line
                   (colon / question / other), each calibrated to 30% large calls on the calibration
                   split plus one augmented copy (seed 11); APGR and CPT are per-wording rankings and
                   do not move, only the decisions (agreement) do

The trial helpers patch module functions of tokenyard.router_models.runtime.features for the
length of one trial (`patched`) and restore them; nothing here changes the shipped artifact.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import time
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tokenyard.bench import router_rewording as rr
from tokenyard.bench.results_io import RunRecorder
from tokenyard.router_models.runtime import features as F
from tokenyard.router_models.runtime.calibration import threshold_for_large_share
from tokenyard.router_models.runtime.layout import STOP_WORDS, canonical, stem
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.augment import augment
from tokenyard.router_models.training.labelled import Labelled
from tokenyard.router_models.training.routing_metrics import apgr, cpt, routing_curve
from tokenyard.router_models.training.train import NORMALISED_WINDOW, load_labels, read_jsonl, train_router

TRIALS = ("base", "intent_token", "intent_replace", "wordnet_all", "wordnet_verbs", "wordnet_pure",
          "engine_hidden", "layout_calibration", "oracle_intent",
          "intent_replace_wordnet")
WORDNET = Path("/usr/share/wordnet")
DEV_SEED = 7                  # the dev copy of calibration (training copies use seed 0)
LAYOUT_SEED = 11              # the extra calibration copy of layout_calibration
INTENT_DIM = 1 << 14
SYNONYM_MIN_FREQ = 20         # a training instruction word must occur this often to be a target
SYNONYM_PURITY = 0.9          # wordnet_pure: ... and this share of its uses must be in one task
TARGET_LARGE = 0.3


def task_key(row: dict) -> str:
    """The suite task, combo split by its kind (the two ask different things)."""
    if row["task"] != "combo":
        return row["task"]
    return "add_twice" if any(ch.isdigit() for ch in row["answer"]) else "reverse_upper"


@contextlib.contextmanager
def patched(**funcs: Callable) -> Iterator[None]:
    """Replace these functions of the features module for the block's length."""
    old = {k: getattr(F, k) for k in funcs}
    try:
        for k, v in funcs.items():
            setattr(F, k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(F, k, v)


# --- intent ---------------------------------------------------------------------------------------

def intent_columns(canon: str, dim: int = INTENT_DIM) -> list[int]:
    """Hashed intent features of a canonical prompt: its instruction words (names as "@"), their
    character 3-5-grams, and the payload's kind (numbers and how many, letters, words, none)."""
    head, _, tail = canon.partition(" : ")
    feats = []
    for w in head.split():
        w = "@" if w[:1].isupper() else w
        feats.append("w:" + w)
        if w != "@":
            p = "<" + w + ">"
            feats += ["c:" + p[i:i + n] for n in (3, 4, 5) for i in range(len(p) - n + 1)]
    toks = tail.split()
    nums = sum(t.isdigit() for t in toks)
    kind = "none" if not toks else f"num{min(nums, 3)}" if nums else \
        "letters" if all(len(t) == 1 for t in toks) else "words"
    feats.append("k:" + kind)
    return [zlib.crc32(f.encode()) % dim for f in feats]


def intent_matrix(canons: list[str], dim: int = INTENT_DIM):
    from scipy.sparse import csr_matrix, diags

    indptr, indices = [0], []
    for c in canons:
        indices += intent_columns(c, dim)
        indptr.append(len(indices))
    X = csr_matrix((np.ones(len(indices)), indices, indptr), shape=(len(canons), dim))
    X.sum_duplicates()
    norm = np.sqrt(np.asarray(X.multiply(X).sum(axis=1)).ravel())
    norm[norm == 0] = 1.0
    return diags(1.0 / norm) @ X


def fit_intent(train: Labelled, keys: list[str]):
    """The intent classifier on train and its two augmented copies (the training seed)."""
    from sklearn.linear_model import LogisticRegression

    aug = augment(train, 2, seed=0)
    texts = train.texts + aug.texts
    y = keys + [keys[i] for i in np.repeat(np.arange(len(train)), 2)]
    X = intent_matrix([canonical(F.window_of(t, NORMALISED_WINDOW)) for t in texts])
    return LogisticRegression(C=1.0, max_iter=3000).fit(X, y)


# --- WordNet synonyms -----------------------------------------------------------------------------

def wordnet_synsets(folder: Path, parts: tuple[str, ...]) -> Iterator[list[str]]:
    """Each synset's lemmas (lower case, '_' between words) from WordNet's data.<pos> files."""
    for pos in parts:
        with open(folder / f"data.{pos}", encoding="latin-1") as f:
            for line in f:
                if line.startswith(" "):        # the licence header
                    continue
                p = line.split()
                n = int(p[3], 16)
                yield [w.split("(")[0].lower() for w in p[4:4 + 2 * n:2]]


def _lemma_key(lemma: str) -> str | None:
    words = [x for x in lemma.replace("-", "_").split("_") if x and x not in STOP_WORDS]
    return stem(words[0]) if len(words) == 1 and words[0].isalpha() else None


def synonym_map(train_texts: list[str], synsets: Iterator[list[str]], min_freq: int = SYNONYM_MIN_FREQ,
                keys: list[str] | None = None, purity: float = 0.0) -> dict[str, str]:
    """word stem -> the training instruction word (>= min_freq uses; with `keys`, the prompts' tasks,
    also >= `purity` of its uses in one task) it shares most synsets with (ties: the more
    frequent, then alphabetical); only words training never used are keys."""
    freq: collections.Counter[str] = collections.Counter()
    by_task: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for i, t in enumerate(train_texts):
        head = canonical(F.window_of(t, NORMALISED_WINDOW)).partition(" : ")[0]
        words = [w for w in head.split() if not w[:1].isupper()]
        freq.update(words)
        if keys is not None:
            for w in words:
                by_task[w][keys[i]] += 1
    targets = {w for w, n in freq.items() if n >= min_freq
               and (keys is None or max(by_task[w].values()) >= purity * n)}
    votes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for lemmas in synsets:
        keys = {k for k in map(_lemma_key, lemmas) if k}
        hit = keys & targets
        for k in keys - set(freq):
            for t in hit:
                votes[k][t] += 1
    return {k: max(c, key=lambda t: (c[t], freq[t], t)) for k, c in votes.items() if c}


# --- measuring ------------------------------------------------------------------------------------

def _stats(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> tuple[float, float]:
    curve = routing_curve(scores, small, large)
    c = cpt(curve, 0.95)
    return apgr(curve), 1.0 if np.isnan(c) else c


class Bench:
    """The benchmark's wordings (seed 0) and outcomes, prepared once."""

    def __init__(self, seed: int = 0) -> None:
        from tokenyard.demo import task_suite
        from tokenyard.demo.router_labels import count_prompt_tokens

        self.rows = rr.load_items(rr.LABELS)
        self.small = np.array([r["small_correct"] for r in self.rows], dtype=float)
        self.large = np.array([r["large_correct"] for r in self.rows], dtype=float)
        self.messages = {rr.FAMILIAR: [r["messages"] for r in self.rows]}
        for fam in rr.FAMILIES:
            self.messages[fam] = [rr.reworded_messages(r, fam, seed) for r in self.rows]
        flat = [task_suite.TaskItem(r["task"], r["level"], -1, tuple(m), r["answer"], "test")
                for msgs in self.messages.values() for r, m in zip(self.rows, msgs)]
        counts = count_prompt_tokens(flat)
        n = len(self.rows)
        self.tokens = {w: counts[i * n:(i + 1) * n] for i, w in enumerate(self.messages)}
        self.texts = {w: [F.prompt_text(m) for m in msgs] for w, msgs in self.messages.items()}

    def figures(self, scores: dict[str, np.ndarray], large_dec: dict[str, np.ndarray]) -> dict[str, dict]:
        base_apgr, _ = _stats(scores[rr.FAMILIAR], self.small, self.large)
        out = {}
        for w, s in scores.items():
            a, c = _stats(s, self.small, self.large)
            out[w] = {"apgr": a, "apgr_minus_familiar": a - base_apgr, "cpt_95": c,
                      "agreement": float((large_dec[w] == large_dec[rr.FAMILIAR]).mean()),
                      "large_share": float(large_dec[w].mean())}
        return out


def dev_figures(score: Callable[[list[str], list[int]], np.ndarray], threshold: float, cal: Labelled) -> dict:
    copy = augment(cal, 1, seed=DEV_SEED)
    s0, s1 = score(cal.texts, cal.tokens), score(copy.texts, copy.tokens)
    sm, lg = cal.small_correct.astype(float), cal.large_correct.astype(float)
    ph3 = np.array([m["phrasing"] == 3 for m in cal.meta])
    return {"calibration_apgr": _stats(s0, sm, lg)[0], "perturbed_apgr": _stats(s1, sm, lg)[0],
            "perturbed_agreement": float(((s0 < threshold) == (s1 < threshold)).mean()),
            "phrasing3_apgr": _stats(s0[ph3], sm[ph3], lg[ph3])[0]}


def _scorer_fn(scorer: Scorer) -> Callable[[list[str], list[int]], np.ndarray]:
    return lambda texts, tokens: np.array([scorer.score(t, n) for t, n in zip(texts, tokens)])


def _artifact_trial(train: Labelled, cal: Labelled, bench: Bench) -> dict:
    art, _ = train_router(train, cal)
    scorer = Scorer(art)
    fn = _scorer_fn(scorer)
    scores = {w: fn(bench.texts[w], bench.tokens[w]) for w in bench.texts}
    return {"dev": dev_figures(fn, scorer.threshold, cal),
            "bench": bench.figures(scores, {w: s < scorer.threshold for w, s in scores.items()}),
            "weights": len(art.indices)}


def trial_intent(train: Labelled, cal: Labelled, bench: Bench, keys: list[str], replace: bool,
                 synonyms: dict[str, str] | None = None) -> dict:
    clf = fit_intent(train, keys)
    classes = [c.replace("_", "") for c in clf.classes_]
    known: set[str] = set()
    proto: dict[str, str] = {}
    for k, t, m in zip(keys, train.texts, train.meta):
        head = canonical(F.window_of(t, NORMALISED_WINDOW)).partition(" : ")[0]
        words = [w for w in head.split() if not w[:1].isupper()]
        known.update(words)
        if m.get("phrasing") == 0:      # the task's phrasing-0 instruction (one template per task)
            proto.setdefault(k.replace("_", ""), " ".join(words))
    cache: dict[str, str] = {}

    def canon(window: str) -> str:
        c = canonical(window)
        out = cache.get(c)
        if out is None:
            head, sep, tail = c.partition(" : ")
            words = [w for w in head.split() if not w[:1].isupper()]
            names = [w for w in head.split() if w[:1].isupper()]
            out = c
            if replace:
                if not words or any(w not in known for w in words):
                    if synonyms:        # unknown words read as their WordNet training synonym
                        c = " ".join(synonyms.get(w, w) for w in head.split()) + sep + tail
                    p = clf.predict_proba(intent_matrix([c]))[0]
                    k = int(np.argmax(p))
                    if p[k] >= 0.5:
                        out = " ".join([proto[classes[k]], *names]) + sep + tail
            else:
                p = clf.predict_proba(intent_matrix([c]))[0]
                k = int(np.argmax(p))
                out = (head + f" intent{classes[k]} iconf{min(int(p[k] * 4), 3)}").strip() + sep + tail
            cache[c] = out
        return out

    bench_keys = np.array([task_key(r) for r in bench.rows])
    accuracy = {w: float((clf.predict(intent_matrix([canonical(F.window_of(t, NORMALISED_WINDOW)) for t in texts]))
                          == bench_keys).mean()) for w, texts in bench.texts.items()}
    with patched(canonical=canon):
        out = _artifact_trial(train, cal, bench)
    out["intent_accuracy_bench"] = accuracy      # the classifier's task, right or wrong, per wording
    return out


def trial_oracle_intent(train: Labelled, cal: Labelled, bench: Bench, keys: list[str], cal_keys: list[str]) -> dict:
    """A diagnostic, not a router: every prompt's instruction words are replaced by its true task's
    phrasing-0 instruction words (the payload kept), in training, calibration and the benchmark
    alike. What is left of the drop then comes from reading the input's size, not the task."""
    proto: dict[str, str] = {}
    for k, t, m in zip(keys, train.texts, train.meta):
        if m.get("phrasing") == 0 and k not in proto:
            head = canonical(F.window_of(t, NORMALISED_WINDOW)).partition(" : ")[0]
            proto[k] = " ".join(w for w in head.split() if not w[:1].isupper())
    truth: dict[str, str] = {}
    aug = augment(train, 2, seed=0)
    bench_keys = [task_key(r) for r in bench.rows]
    pairs = [*zip(train.texts, keys), *zip(aug.texts, np.repeat(keys, 2).tolist()), *zip(cal.texts, cal_keys),
             *((t, k) for texts in bench.texts.values() for t, k in zip(texts, bench_keys))]
    for text, k in pairs:
        truth[canonical(F.window_of(text, NORMALISED_WINDOW))] = k

    def canon(window: str) -> str:
        c = canonical(window)
        k = truth.get(c)
        if k is None:
            return c
        head, sep, tail = c.partition(" : ")
        return " ".join([proto[k], *(w for w in head.split() if w[:1].isupper())]) + sep + tail

    with patched(canonical=canon):
        return _artifact_trial(train, cal, bench)


def trial_wordnet(train: Labelled, cal: Labelled, bench: Bench, folder: Path, parts: tuple[str, ...],
                  keys: list[str] | None = None, purity: float = 0.0) -> dict:
    smap = synonym_map(train.texts, wordnet_synsets(folder, parts), keys=keys, purity=purity)
    repair = F._known

    def known(word: str, vocab: frozenset[int]) -> str | None:
        out = repair(word, vocab)
        return out if out is not None else smap.get(word)

    with patched(_known=known):
        out = _artifact_trial(train, cal, bench)
    out["synonyms"] = len(smap)
    out["synonym_targets"] = dict(collections.Counter(smap.values()).most_common())
    return out


def trial_layout_calibration(train: Labelled, cal: Labelled, bench: Bench) -> dict:
    art, _ = train_router(train, cal)
    scorer = Scorer(art)
    fn = _scorer_fn(scorer)

    def layout(text: str) -> str:
        last = text.rstrip().rsplit("\n", 1)[-1]
        return "colon" if ":" in last else "question" if last.rstrip().endswith("?") else "other"

    copy = augment(cal, 1, seed=LAYOUT_SEED)
    texts, tokens = cal.texts + copy.texts, cal.tokens + copy.tokens
    s = fn(texts, tokens)
    cls = np.array([layout(t) for t in texts])
    thr = {c: threshold_for_large_share(s[cls == c], TARGET_LARGE) for c in sorted(set(cls.tolist()))}
    scores = {w: fn(bench.texts[w], bench.tokens[w]) for w in bench.texts}
    dec = {w: np.array([sc < thr.get(layout(t), scorer.threshold) for sc, t in zip(scores[w], bench.texts[w])])
           for w in scores}
    return {"bench": bench.figures(scores, dec), "thresholds": thr,
            "calibration_prompts_per_class": {c: int((cls == c).sum()) for c in thr}}


def trial_engine_hidden(train: Labelled, cal: Labelled, bench: Bench, train_rows: list[dict],
                        cal_rows: list[dict]) -> dict:
    import torch
    from scipy.sparse import csr_matrix, hstack
    from transformers import LlamaForCausalLM

    from tokenyard.engines.text.chat_template import apply_chat_template
    from tokenyard.engines.text.tokenizer import Tokenizer
    from tokenyard.router_models.training.labelled import concat
    from tokenyard.router_models.training.train import fit_matrix, prepare_spec

    torch.set_num_threads(1)
    folder = rr.ROOT / "models" / "demo-small"
    tok = Tokenizer.from_dir(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def ids(messages: list[dict]) -> list[int]:
        return tok.encode(apply_chat_template(tok, messages, add_generation_prompt=True), add_special_tokens=False)

    @torch.no_grad()
    def hidden(message_lists: list[list[dict]], batch: int = 64) -> np.ndarray:
        seqs = [ids(m) for m in message_lists]
        out = np.zeros((len(seqs), 3 * model.config.hidden_size), np.float32)
        order = np.argsort([len(x) for x in seqs])
        for s in range(0, len(seqs), batch):
            b = order[s:s + batch]
            width = max(len(seqs[i]) for i in b)
            x = torch.zeros((len(b), width), dtype=torch.long)
            mask = torch.zeros((len(b), width), dtype=torch.long)
            for j, i in enumerate(b):
                x[j, :len(seqs[i])] = torch.tensor(seqs[i])
                mask[j, :len(seqs[i])] = 1
            h = model(input_ids=x, attention_mask=mask, output_hidden_states=True).hidden_states
            m = mask.unsqueeze(-1).float()
            last = h[-1][torch.arange(len(b)), mask.sum(1) - 1]
            out[b] = torch.cat([(h[-1] * m).sum(1) / m.sum(1), (h[2] * m).sum(1) / m.sum(1), last], 1).numpy()
        return out

    def as_messages(text: str, system: bool) -> list[dict]:
        if system:
            s, _, u = text.partition("\n")
            return [{"role": "system", "content": s}, {"role": "user", "content": u}]
        return [{"role": "user", "content": text}]

    # batch-1 prefill cost, what a router reading the engine's view would add without KV reuse
    times = []
    with torch.no_grad():
        for m in bench.messages[rr.FAMILIAR][:200]:
            x = torch.tensor([ids(m)])
            t0 = time.perf_counter()
            model(input_ids=x, output_hidden_states=True)
            times.append(time.perf_counter() - t0)
    aug = augment(train, 2, seed=0)
    system = [len(r["messages"]) > 1 for r in train_rows]
    t0 = time.perf_counter()
    H_fit = np.vstack([hidden([r["messages"] for r in train_rows]),
                       hidden([as_messages(t, system[i // 2]) for i, t in enumerate(aug.texts)])])
    H_cal = hidden([r["messages"] for r in cal_rows])
    H_bench = {w: hidden(msgs) for w, msgs in bench.messages.items()}
    batched_s = time.perf_counter() - t0
    fit_on = concat(train, aug)
    spec = prepare_spec(train)
    X_fit = F.matrix(fit_on.texts, fit_on.tokens, spec)
    X_cal = F.matrix(cal.texts, cal.tokens, spec)
    X_bench = {w: F.matrix(bench.texts[w], bench.tokens[w], spec) for w in bench.texts}
    mu, sd = H_fit.mean(0), H_fit.std(0) + 1e-6
    out: dict = {"prefill_batch1_ms": {"p50": float(np.percentile(times, 50) * 1e3),
                                       "p99": float(np.percentile(times, 99) * 1e3), "prompts": len(times)},
                 "hidden_batched_s": batched_s, "variants": {}}
    for name, alpha, alone in (("text+hidden x1", 1.0, False), ("text+hidden x3", 3.0, False),
                               ("hidden alone", 1.0, True)):
        def rows(X, H):
            h = csr_matrix(alpha * (H - mu) / sd / np.sqrt(H.shape[1]))
            return h.tocsr() if alone else hstack([X, h]).tocsr()
        clf = fit_matrix(rows(X_fit, H_fit), fit_on.targets("small_enough"))
        thr = threshold_for_large_share(clf.predict_proba(rows(X_cal, H_cal))[:, 1], TARGET_LARGE)
        scores = {w: clf.predict_proba(rows(X_bench[w], H_bench[w]))[:, 1] for w in bench.texts}
        out["variants"][name] = {"bench": bench.figures(scores, {w: s < thr for w, s in scores.items()})}
    return out


def run(trials: tuple[str, ...], wordnet: Path) -> dict:
    train, cal = load_labels(rr.LABELS / "train.jsonl"), load_labels(rr.LABELS / "calibration.jsonl")
    train_rows, cal_rows = read_jsonl(rr.LABELS / "train.jsonl"), read_jsonl(rr.LABELS / "calibration.jsonl")
    keys = [task_key(r) for r in train_rows]
    bench = Bench()
    out: dict[str, dict] = {}
    for name in trials:
        t0 = time.perf_counter()
        if name == "base":
            res = _artifact_trial(train, cal, bench)
        elif name in ("intent_token", "intent_replace"):
            res = trial_intent(train, cal, bench, keys, replace=name == "intent_replace")
        elif name == "intent_replace_wordnet":
            if not (wordnet / "data.verb").is_file():
                res = {"skipped": f"no WordNet data files in {wordnet} (Debian: wordnet-base)"}
            else:
                smap = synonym_map(train.texts, wordnet_synsets(wordnet, ("noun", "verb", "adj", "adv")),
                                   keys=keys, purity=SYNONYM_PURITY)
                res = trial_intent(train, cal, bench, keys, replace=True, synonyms=smap)
        elif name in ("wordnet_all", "wordnet_verbs", "wordnet_pure"):
            if not (wordnet / "data.verb").is_file():
                res = {"skipped": f"no WordNet data files in {wordnet} (Debian: wordnet-base)"}
            else:
                parts = ("verb",) if name == "wordnet_verbs" else ("noun", "verb", "adj", "adv")
                res = trial_wordnet(train, cal, bench, wordnet, parts, *((keys, SYNONYM_PURITY)
                                                                         if name == "wordnet_pure" else ()))
        elif name == "engine_hidden":
            res = trial_engine_hidden(train, cal, bench, train_rows, cal_rows)
        elif name == "oracle_intent":
            res = trial_oracle_intent(train, cal, bench, keys, [task_key(r) for r in cal_rows])
        elif name == "layout_calibration":
            res = trial_layout_calibration(train, cal, bench)
        else:
            raise ValueError(f"unknown trial {name!r}; known: {', '.join(TRIALS)}")
        res["seconds"] = time.perf_counter() - t0
        out[name] = res
        _print(name, res)
    return {"items": len(bench.rows), "trials": out}


def _line(b: dict) -> str:
    return " | ".join(f"{w} {f['apgr']:.3f} ({f['apgr_minus_familiar']:+.3f}, {f['agreement'] * 100:.1f}%, "
                      f"CPT {f['cpt_95'] * 100:.0f}%)" for w, f in b.items())


def _print(name: str, res: dict) -> None:
    if "skipped" in res:
        print(f"{name}: skipped ({res['skipped']})")
        return
    if "dev" in res:
        d = res["dev"]
        print(f"{name} dev: calibration APGR {d['calibration_apgr']:.3f}, perturbed {d['perturbed_apgr']:.3f}, "
              f"agreement {d['perturbed_agreement'] * 100:.1f}%, phrasing 3 APGR {d['phrasing3_apgr']:.3f}")
    if "bench" in res:
        print(f"{name} bench: {_line(res['bench'])}")
    for v, r in res.get("variants", {}).items():
        print(f"{name} [{v}] bench: {_line(r['bench'])}")
    if "intent_accuracy_bench" in res:
        print(f"{name}: intent right on " + ", ".join(f"{w} {a * 100:.1f}%" for w, a in res["intent_accuracy_bench"].items()))
    if "prefill_batch1_ms" in res:
        p = res["prefill_batch1_ms"]
        print(f"{name}: demo-small batch-1 prefill p50 {p['p50']:.2f} ms, p99 {p['p99']:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", default=",".join(TRIALS), help=f"comma-separated, of {', '.join(TRIALS)}")
    ap.add_argument("--wordnet", default=str(WORDNET), help="folder with WordNet 3.0's data.<pos> files")
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--results-name", default="router_feature_trials")
    args = ap.parse_args(argv)
    trials = tuple(t for t in args.trials.split(",") if t)
    unknown = [t for t in trials if t not in TRIALS]
    if unknown:
        ap.error(f"unknown trials {unknown}; known: {', '.join(TRIALS)}")
    rec = RunRecorder(args.results_name)
    report = run(trials, Path(args.wordnet))
    if not args.no_results:
        rec.write(report, [{"trial": k, **v} for k, v in report["trials"].items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
