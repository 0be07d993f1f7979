"""The demo training command runs end to end in smoke mode, so it cannot rot; on one machine a
rerun gives the same weights bit for bit (across machines only accuracy reproduces: see
tokenyard/demo/train.py and tests/demo/test_demo_models.py)."""
import json

import pytest
import torch

from tokenyard.demo.train import SPECS, TrainConfig, make_model, train
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.text.tokenizer import Tokenizer

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


def test_rerun_on_one_machine_gives_the_same_bits(tmp_path):
    from safetensors.torch import load_file

    cfg = dict(steps=2, batch_size=4, eval_every=2, checkpoint_every=2, eval_items=8, train_pool=32,
               tokenizer_corpus=2000, vocab_size=600, warmup=1)
    runs = []
    for name in ("a", "b"):
        root = tmp_path / name
        train(SPECS["small"], root / "run", root / "model", root / "tok", TrainConfig(**cfg), progress=False)
        runs.append(load_file(root / "model" / "model.safetensors"))
    assert runs[0].keys() == runs[1].keys()
    for key, tensor in runs[0].items():
        assert torch.equal(tensor, runs[1][key]), key
    # and training moved them: the comparison is not between two untouched initialisations
    init = make_model(SPECS["small"], Tokenizer.from_dir(tmp_path / "a" / "model"), TrainConfig(**cfg).seed)
    moved = {k: v for k, v in init.state_dict().items() if k in runs[0]}
    assert moved and any(not torch.equal(v.to(runs[0][k].dtype), runs[0][k]) for k, v in moved.items())


def test_cli_smoke(capsys):
    from tokenyard.cli.main import main

    assert main(["demo", "train", "--which", "small", "--smoke"]) == 0
    assert "wrote" in capsys.readouterr().out
