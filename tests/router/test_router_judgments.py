"""`tokenyard router train --labels FILE`: operator judgements (prompt, engine, good/score) per line."""
import json
from pathlib import Path

import numpy as np
import pytest

from tokenyard.router_models.runtime.artifact import load
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.cli import main as router_main
from tokenyard.router_models.training.judgments import read_judgements, to_labelled

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tokenyard" / "router_models" / "data"


def _write(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("bad, reason", [
    ("{not json", r"judged\.jsonl:3: not valid JSON"),
    ('["a list"]', r":3: expected a JSON object, got list"),
    ({"prompt": "hi", "engine": "s"}, r":3: give exactly one of good .* and score"),
    ({"prompt": "hi", "engine": "s", "good": True, "score": 1}, r":3: give exactly one of good"),
    ({"prompt": "hi", "engine": "s", "good": "yes"}, r":3: good must be true or false"),
    ({"prompt": "hi", "engine": "s", "score": 1.5}, r":3: score must be a number in \[0, 1\]"),
    ({"prompt": "hi", "engine": "s", "score": True}, r":3: score must be a number"),
    ({"prompt": "", "engine": "s", "good": True}, r":3: prompt must be non-empty text"),
    ({"engine": "s", "good": True}, r":3: give the request as exactly one of prompt .* and messages"),
    ({"messages": [{"role": "user"}], "engine": "s", "good": True}, r":3: messages must be"),
    ({"prompt": "hi", "good": True}, r":3: engine must be a non-empty engine name"),
    ({"prompt": "hi", "engine": "s", "good": True, "prompt_tokens": -1}, r":3: prompt_tokens must be"),
    ({"prompt": "hi", "engine": "s", "good": True, "label": 1}, r":3: unknown keys label"),
])
def test_malformed_lines_are_refused_with_their_line_number(tmp_path, bad, reason, capsys):
    ok = {"prompt": "Add 1 and 2.", "engine": "s", "good": True, "prompt_tokens": 9}
    path = _write(tmp_path / "judged.jsonl", [ok, "", bad, ok])     # line 2 blank: skipped
    with pytest.raises(ValueError, match=reason):
        read_judgements(path)
    assert router_main(["train", "--labels", str(path), "--out", str(tmp_path / "r.json")]) == 2
    assert "judged.jsonl:3:" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_prompts_become_small_and_large_qualities(tmp_path):
    path = _write(tmp_path / "j.jsonl", [
        {"prompt": "a", "engine": "S", "good": True, "prompt_tokens": 3},
        {"prompt": "a", "engine": "L", "score": 0.5},
        {"prompt": "a", "engine": "S", "good": False},                 # repeated judgements average
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "b"}], "engine": "S",
         "good": False, "prompt_tokens": 4},                           # small only: large assumed good
        {"prompt": "c", "engine": "L", "good": True, "prompt_tokens": 1},   # large only: left out
        {"prompt": "a", "engine": "other", "good": True},
    ])
    data, summary = to_labelled(read_judgements(path), "S", "L", path)
    assert data.texts == ["a", "x\nb"] and data.tokens == [3, 4]
    assert data.small_correct.tolist() == [0.5, 0.0] and data.large_correct.tolist() == [0.5, 1.0]
    assert data.labels.tolist() == [1, 0]
    assert data.targets("expected_gain").tolist() == [0.5, 0.0]
    assert data.targets("small_enough").tolist() == [1.0, 0.0]
    assert (summary.both_engines, summary.small_only, summary.large_only_skipped, summary.other_engine_lines) == \
        (1, 1, 1, 1)
    with pytest.raises(ValueError, match="no line names engine 'x' or 'y'.*engines in the file: L, S, other"):
        to_labelled(read_judgements(path), "x", "y", path)
    with pytest.raises(ValueError, match=r"j\.jsonl:1: prompt_tokens missing"):
        to_labelled(read_judgements(_write(tmp_path / "j.jsonl", [{"prompt": "z", "engine": "S", "good": True}])),
                    "S", "L", path)


def test_train_from_a_judgement_file_end_to_end(tmp_path, capsys):
    """The README's worked example, on 800 suite prompts turned into judgement lines."""
    rows = [json.loads(line) for line in (DATA / "calibration.jsonl").read_text().splitlines()[:800]]
    lines = []
    for r in rows:
        lines.append({"messages": r["messages"], "engine": "demo-small", "good": r["small_correct"],
                      "prompt_tokens": r["prompt_tokens"]})
        lines.append({"prompt": r["prompt"], "engine": "demo-large", "good": r["large_correct"]})
    path = _write(tmp_path / "judged.jsonl", lines)
    out = tmp_path / "router.json"
    assert router_main(["train", "--labels", str(path), "--out", str(out), "--target-large-share", "0.25",
                        "--objective", "expected_gain"]) == 0
    printed = capsys.readouterr().out
    unique = len({r["prompt"] for r in rows})          # a repeated prompt's judgements are averaged
    assert f"{unique} prompts ({unique} judged on both engines, 0 on the small one only)" in printed
    art = load(out)
    assert art.training["source"] == "judgements" and art.training["labels"] == "expected_gain"
    assert art.threshold_target == 0.25 and 0.15 < art.calibration_prompts / unique < 0.35
    scorer = Scorer(art)
    scores = np.array([scorer.score(r["prompt"], r["prompt_tokens"]) for r in rows])
    # the ranking means something: prompts only the large engine got right score lowest
    large_only = np.array([r["large_correct"] and not r["small_correct"] for r in rows])
    assert scores[large_only].mean() < scores[~large_only].mean() - 0.05
