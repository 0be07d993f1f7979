"""The demo training command runs end to end in smoke mode, so it cannot rot."""
import json

import pytest

from demo.train import SPECS, TrainConfig, train
from engines import LLM, SamplingParams

pytest.importorskip("transformers")


def test_train_smoke_then_resume_then_serve(tmp_path):
    cfg = TrainConfig(steps=2, batch_size=4, eval_every=2, checkpoint_every=2, eval_items=16, train_pool=64,
                      tokenizer_corpus=2000, vocab_size=600, warmup=1)
    hist = train(SPECS["small"], tmp_path / "run", tmp_path / "model", tmp_path / "tok", cfg, progress=False)
    assert hist.steps == [2] and set(hist.exact) >= {"add", "copy"}
    # Resume: the saved state continues from step 2 instead of starting over.
    cfg.steps = 4
    cfg.eval_every = 4
    hist = train(SPECS["small"], tmp_path / "run", tmp_path / "model", tmp_path / "tok", cfg, progress=False)
    assert hist.steps == [2, 4]
    assert json.loads((tmp_path / "run" / "history.json").read_text())["steps"] == [2, 4]
    # The saved HF checkpoint loads through the engine, with its tokenizer and chat template.
    llm = LLM(tmp_path / "model", kv_cache_memory=4 << 20)
    out = llm.chat([{"role": "user", "content": "Add 2 and 3."}], SamplingParams(temperature=0.0, max_tokens=5),
                   use_tqdm=False)[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert llm.engine.eos_token_ids == frozenset({llm.tokenizer.token_to_id("<|end|>")})


def test_cli_smoke(capsys):
    from gateway.cli import main

    assert main(["demo", "train", "--which", "small", "--smoke"]) == 0
    assert "wrote" in capsys.readouterr().out
