"""Loading failures name what is wrong."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenyard.engines import CheckpointError, Engine


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(checkpoint_dir, tmp_path):
    d = _copy(checkpoint_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPTNeoXForCausalLM'"):
        Engine(d, kv_cache_memory=1 << 20)


def _edited(checkpoint_dir, tmp_path, edit):
    """A copy of the llama checkpoint whose tensors dict went through `edit`."""
    d = _copy(checkpoint_dir("llama"), tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def test_missing_tensor(checkpoint_dir, tmp_path):
    d = _edited(checkpoint_dir, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        Engine(d, kv_cache_memory=1 << 20)


def test_shape_mismatch(checkpoint_dir, tmp_path):
    bad = {"model.layers.0.self_attn.k_proj.weight": torch.zeros(7, 64)}
    d = _edited(checkpoint_dir, tmp_path, lambda t: t.update(bad))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(7, 64\)"):
        Engine(d, kv_cache_memory=1 << 20)


def test_unexpected_tensor(checkpoint_dir, tmp_path):
    d = _edited(checkpoint_dir, tmp_path, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match="unexpected tensor.*mystery"):
        Engine(d, kv_cache_memory=1 << 20)


def test_sharded_checkpoint_loads(checkpoint_dir, tmp_path):
    src = checkpoint_dir("llama")
    d = tmp_path / "sharded"
    d.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, d / name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / file)
        weight_map.update({k: file for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = Engine(src, kv_cache_memory=1 << 20, progress=False)
    b = Engine(d, kv_cache_memory=1 << 20, progress=False)
    for (n1, p1), (n2, p2) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00002"):
        Engine(d, kv_cache_memory=1 << 20)


def test_no_weights(tmp_path, checkpoint_dir):
    d = tmp_path / "empty"
    d.mkdir()
    shutil.copy(checkpoint_dir("llama") / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        Engine(d, kv_cache_memory=1 << 20)
    with pytest.raises(CheckpointError, match="no config.json"):
        Engine(tmp_path / "nowhere", kv_cache_memory=1 << 20)
