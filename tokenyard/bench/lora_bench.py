"""LoRA adapters in the engine (issue 53): what serving many adapters in one batch costs.

Figures, on one engine of the base with `--adapters` random rank-`--rank` adapters on all seven
projections (PEFT's format, written here; tokenyard/engines/lora):
- decode step time of `--batch` sequences, all on the base vs spread evenly over the adapters
  (the same engine, rounds interleaved; median over the timed steps): the issue's goal is <= 1.3x;
  "adapters" is the engine as it runs (on a CPU with an fp32 base: the C kernel, one call per fused
  projection, tokenyard/kernels/cpu_lora.c), "adapters_torch" the same batch through the torch forms
  (the kernel off: the batched form for steps of <= BATCHED_MAX_ROWS rows), "adapters_segments" through the
  torch segment loop (the kernel off, BATCHED_MAX_ROWS set to 0), all in the same run for comparison;
- adapter load time: reading and checking one adapter and copying it into a pool slot (the pool has
  one slot, so every acquire of the other adapter is a load; median): the goal is <= 50 ms;
- start-up cost of the shipped demo adapters (tokenyard/models/demo-large-lora, in the default
  deployment's demo-large engine): Engine construction of the base with and without them, interleaved,
  median of `--startup-rounds`.

    python -m tokenyard.bench.lora_bench [--model tokenyard/models/demo-large] [--batch 32] [--adapters 8] [--name N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
MODES = ("base", "adapters", "adapters_torch", "adapters_segments")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base_dir: Path, out: Path, rank: int, seed: int, std: float = 0.02) -> Path:
    """A random PEFT LoRA adapter for the checkpoint at base_dir (adapter_config.json + safetensors)."""
    from safetensors.torch import save_file

    from tokenyard.engines.lora.adapter_loader import module_shapes
    from tokenyard.engines.model.model_config import ModelConfig

    cfg = ModelConfig.from_dir(base_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m, (n_in, n_out) in module_shapes(cfg).items():
            where = "self_attn" if m in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{where}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "base_model_name_or_path": str(base_dir)}))
    return out


def decode_step_times(engine, names: list[str | None], steps: int, prompt_len: int, tag: str) -> list[float]:
    """Seconds of each of `steps` decode steps of len(names) sequences (after their prefill)."""
    from tokenyard.engines import SamplingParams

    for i, name in enumerate(names):
        params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True, lora=name)
        engine.add_request(f"{tag}-{i}", [(7 * i + j) % 1900 + 10 for j in range(prompt_len)], params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running) or not engine.scheduler.running:
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for i in range(len(names)):
        engine.abort(f"{tag}-{i}")
    while engine.has_unfinished():
        engine.step()
    return times


def demo_adapter_startup(base: Path, rounds: int) -> dict:
    """Engine start-up of base with and without the committed demo adapters (medians, ms)."""
    from tokenyard.demo.train_lora import ADAPTERS
    from tokenyard.engines import Engine

    modules = {p.name: str(p) for p in sorted(ADAPTERS.iterdir()) if (p / "adapter_config.json").is_file()}
    if not modules or rounds <= 0:
        return {}
    times: dict[str, list[float]] = {"base": [], "with_adapters": []}
    for _ in range(rounds):
        for mode, lora in (("base", None), ("with_adapters", modules)):
            t0 = time.perf_counter()
            engine = Engine(base, lora_modules=lora, kv_cache_memory=128 << 20, progress=False)
            times[mode].append(time.perf_counter() - t0)
            del engine
    base_ms, with_ms = (statistics.median(times[m]) * 1e3 for m in ("base", "with_adapters"))
    return {"demo_adapters": sorted(modules), "startup_base_ms": base_ms, "startup_with_demo_adapters_ms": with_ms,
            "startup_demo_adapters_extra_ms": with_ms - base_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "tokenyard" / "models" / "demo-large"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--loads", type=int, default=20)
    ap.add_argument("--startup-rounds", type=int, default=5)
    ap.add_argument("--name", default="lora_adapters", help="results file: bench/results/NAME.json")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tokenyard.bench.results_io import RunRecorder
    from tokenyard.engines import Engine
    from tokenyard.engines.lora import adapter_pool
    from tokenyard.engines.lora.adapter_pool import AdapterPool

    rec = RunRecorder(args.name)
    base = Path(args.model)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        names = [f"a{i}" for i in range(args.adapters)]
        modules = {n: str(write_adapter(base, Path(tmp) / n, args.rank, seed=i)) for i, n in enumerate(names)}
        engine = Engine(base, lora_modules=modules, max_loaded_adapters=args.adapters, max_num_seqs=args.batch,
                        max_num_batched_tokens=max(512, args.batch * args.prompt_len), kv_cache_memory=256 << 20,
                        progress=False)
        spread = [names[i % args.adapters] for i in range(args.batch)]
        runs = []
        lora_pool = engine.lora
        native = lora_pool.native          # the C kernel, or None (no compiler, TOKENYARD_CPU_LORA=torch, not fp32)
        for r in range(args.rounds):
            for mode in MODES:
                if mode == "adapters_torch" and native is None:
                    continue            # without the kernel "adapters" already is the torch batched form
                batch_names = [None] * args.batch if mode == "base" else spread
                batched_rows = adapter_pool.BATCHED_MAX_ROWS
                adapter_pool.BATCHED_MAX_ROWS = 0 if mode == "adapters_segments" else batched_rows
                lora_pool.native = None if mode in ("adapters_torch", "adapters_segments") else native
                try:
                    t = decode_step_times(engine, batch_names, args.steps, args.prompt_len, f"{mode}{r}")
                finally:
                    adapter_pool.BATCHED_MAX_ROWS = batched_rows
                    lora_pool.native = native
                runs.append({"round": r, "mode": mode, "step_s": t})
                print(mode, r, f"median step {statistics.median(t) * 1e3:.2f} ms", flush=True)
        # load: a one-slot pool of two adapters, acquired in turn: every acquire reads one from disk
        pool = AdapterPool({n: modules[n] for n in names[:2]}, engine.model_config, engine.dtype, engine.device,
                           max_loaded=1, max_rank=64)
        loads = []
        for i in range(args.loads):
            before = pool.load_seconds
            t0 = time.perf_counter()
            pool.acquire({pool.id_of(names[(i + 1) % 2])})
            loads.append({"acquire_s": time.perf_counter() - t0, "read_check_s": pool.load_seconds - before})
        slot_mib = pool.slot_bytes / 2**20
    startup = demo_adapter_startup(base, args.startup_rounds)
    med = {m: statistics.median(s for run in runs if run["mode"] == m for s in run["step_s"])
           for m in MODES if any(run["mode"] == m for run in runs)}
    figures = {"batch": args.batch, "adapters": args.adapters, "rank": args.rank, "threads": args.threads,
               "base_step_ms": med["base"] * 1e3, "adapters_step_ms": med["adapters"] * 1e3,
               "adapters_over_base": med["adapters"] / med["base"], "goal_step_ratio": 1.3,
               "adapters_segments_step_ms": med["adapters_segments"] * 1e3,
               "adapters_segments_over_base": med["adapters_segments"] / med["base"],
               "lora_native": native is not None,
               "adapters_torch_step_ms": med["adapters_torch"] * 1e3 if "adapters_torch" in med else None,
               "adapters_torch_over_base": med["adapters_torch"] / med["base"] if "adapters_torch" in med else None,
               "adapter_load_ms": statistics.median(x["acquire_s"] for x in loads) * 1e3, "goal_load_ms": 50,
               "pool_slot_mib": slot_mib, "lora_eager_steps": engine.stats().lora_eager_steps, **startup}
    print(json.dumps(figures, indent=1))
    if not args.no_results:
        print("wrote", rec.write(figures, runs, loads=loads, model=str(base), steps=args.steps,
                                 rounds=args.rounds, prompt_len=args.prompt_len))


if __name__ == "__main__":
    main()
