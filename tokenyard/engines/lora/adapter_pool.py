"""The engine's adapters: a registry of names and a fixed pool of slots on the device, LRU.

    pool = AdapterPool({"sql": "/adapters/sql"}, model_cfg, dtype, device, max_loaded=4, max_rank=64)
    pool.id_of("sql")                    # 1.. (0 is the base); RequestError for an unknown name
    pool.begin_step(row_ids)             # the step's rows grouped by adapter (loads what is missing)
    ... model forward: every layer's LayerLora reads pool.segments ...
    pool.end_step()

Memory is fixed at start-up, per fused projection of the decoder (qkv, o, gate_up, down: the model's
own groups) that any adapter touches: A [layers, slots, G * R, in] and B transposed, [layers, slots,
G * R, out], in the model's dtype, G the group's modules, R the largest rank among the registered
adapters. Module j of a group has A rows j*R..(j+1)*R and, in B, those rows times its own output columns
(B is block-diagonal over the modules: G x the memory of separate B's, for G <= 3). A slot holds one
adapter, zero-padded past its own rank and in modules it does not adapt (zeros add nothing). So a
layer's group is one [slots, G * R, in] and one [slots, G * R, out], both contiguous per slot: the
batched form of tokenyard/kernels/lora_torch.py is a few calls per fused projection for every adapter
at once, its expand GEMM reading B in order; `a_of` / `b_of` are the per-module [slots, R, in] /
[slots, out, R] views the segment kernels read (b_of strided). Every adapter is read and checked at
start-up (a bad one fails the engine's start, naming the tensor); the first max_loaded stay in their
slots, the others are read again from disk when a step needs them, taking the least recently used slot
that the step does not need. The scheduler never puts more adapters in one step than there are slots
(SchedulerConfig.max_adapters).

Run time (`register` / `unregister`, on the step thread, between steps): an adapter loaded while the
engine serves is read and checked like a start-up one, and must also fit the pool as it was sized: rank at
most the pool's R and only modules the pool has room for (an AdapterError naming the tensor otherwise);
it takes a free slot at once, else waits on disk for its first step like any evicted adapter. Unloading
forgets the name and frees its slot; the engine refuses it while requests still run with the adapter.

Identity: each registered adapter gets an id at registration, never reused (an adapter unloaded and
loaded again gets a new one); the prefix cache keys blocks by it
(tokenyard/engines/core/block_manager.py), so KV computed under one adapter is never reused by
another or by the base. Runs on the engine's step thread only.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import torch

from tokenyard.engines.core.sampling_params import ParamError
from tokenyard.engines.lora.adapter_config import TARGET_MODULES, AdapterError
from tokenyard.engines.lora.adapter_errors import AdapterConflict, AdapterNotFound, check_adapter_name
from tokenyard.engines.lora.adapter_loader import GROUPS, Adapter, group_layout, load_adapter
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.kernels import cpu_lora_native
from tokenyard.kernels.lora_torch import LoraSegments, batched_layout, build_segments

log = logging.getLogger(__name__)

# On a CPU with an fp32 pool the products run in C (tokenyard/kernels/cpu_lora_native.py): one call per fused
# projection for every adapter segment of a step, whatever the number of rows; the segments' descriptor is made
# once per step (begin_step). The torch forms below serve other dtypes, machines without a C compiler and
# TOKENYARD_CPU_LORA=torch.
# Steps of at most this many token rows (decode batches, short mixed steps) take the batched form of the
# torch products on a CPU: every slot's rows padded to the longest segment and multiplied in two batched
# GEMMs per fused projection (tokenyard/kernels/lora_torch.py), instead of a loop over the adapters'
# segments whose per-segment calls cost more than the products at these sizes. Padding costs work in
# proportion to the longest segment, which long prefill chunks would feel.
BATCHED_MAX_ROWS = 64


class AdapterPool:
    def __init__(self, modules: dict[str, str | Path], base: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_loaded: int = 4, max_rank: int = 64) -> None:
        if not modules:
            raise ValueError("an adapter pool needs at least one adapter")
        self.base, self.dtype, self.device = base, dtype, device
        self.max_rank = max_rank
        self.num_slots = max_loaded
        self.ids: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self.paths: dict[int, Path] = {}
        adapters: list[Adapter] = []
        for name, path in modules.items():
            adapter = load_adapter(name, path, base, dtype, max_rank)    # AdapterError names the tensor
            adapter_id = len(self.ids) + 1
            self.ids[name], self.names[adapter_id], self.paths[adapter_id] = adapter_id, name, Path(path)
            adapters.append(adapter)
        self.rank = max(a.config.rank for a in adapters)
        self.modules = tuple(m for m in TARGET_MODULES if any(m in a.modules for a in adapters))
        L, S, R = base.num_layers, max_loaded, self.rank
        layout = group_layout(base)
        self.groups = tuple(g for g, mods in GROUPS.items() if any(m in self.modules for m in mods))
        self.width = {g: len(GROUPS[g]) * R for g in self.groups}      # G * R columns per slot
        # module -> (group, index in the group, output offset, output width)
        self.place = {m: (g, j, off, n) for g in self.groups for j, (m, off, n) in enumerate(layout[g][2])}
        self.a = {g: torch.zeros(L, S, self.width[g], layout[g][0], dtype=dtype, device=device) for g in self.groups}
        self.b = {g: torch.zeros(L, S, self.width[g], layout[g][1], dtype=dtype, device=device) for g in self.groups}
        self.scales = torch.zeros(S, dtype=torch.float32, device=device)
        self.slot_rank = [0] * S
        self.slot_scale = [0.0] * S
        self.loaded: OrderedDict[int, int] = OrderedDict()   # adapter id -> slot, least recently used first
        self.free_slots = list(range(S))
        self.segments: LoraSegments | None = None             # the current step's, while a forward runs
        self.triton = device.type == "cuda"
        # the C kernel for the products (None: the torch forms); LayerLora reads it when it is attached
        self.native = cpu_lora_native.load() if device.type == "cpu" and dtype == torch.float32 else None
        self.num_loads = 0
        self.num_evictions = 0
        self.load_seconds = 0.0
        self._next_id = len(self.ids) + 1      # ids are never reused: the prefix cache keys blocks by them
        for adapter in adapters[:max_loaded]:
            self._put(self.ids[adapter.name], adapter)
        log.info("LoRA adapters: %s (rank %d pool, %d slots, modules %s)", ", ".join(self.ids), R, S,
                 ", ".join(self.modules))

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values())) // self.num_slots

    def a_of(self, module: str, layer: int) -> torch.Tensor:
        """A of every slot for one layer's module: a [slots, R, in] view."""
        g, j, _, _ = self.place[module]
        return self.a[g][layer][:, j * self.rank:(j + 1) * self.rank]

    def b_of(self, module: str, layer: int) -> torch.Tensor:
        """B of every slot for one layer's module: a [slots, out, R] view (strided)."""
        g, j, off, n = self.place[module]
        return self.b[g][layer][:, j * self.rank:(j + 1) * self.rank, off:off + n].transpose(1, 2)

    def id_of(self, name: str | None) -> int:
        """0 for the base (None), else the adapter's id; ParamError for a name not registered."""
        if name is None:
            return 0
        adapter_id = self.ids.get(name)
        if adapter_id is None:
            raise ParamError(f"unknown LoRA adapter {name!r}; this engine serves: {', '.join(sorted(self.ids))}",
                             "lora", "lora_not_found")
        return adapter_id

    @property
    def resident(self) -> list[str]:
        """The adapters in a slot now, least recently used first."""
        return [self.names[i] for i in self.loaded]

    # -- run time (step thread, between steps) ------------------------------------------------------
    def register(self, name: str, path: str | Path) -> dict:
        """Read, check and register an adapter while the engine serves; AdapterError when it cannot be
        served (names the tensor), AdapterConflict when the name is taken. Returns what was loaded."""
        check_adapter_name(name)
        if name in self.ids:
            raise AdapterConflict(f"LoRA adapter {name!r} is already loaded (from {self.paths[self.ids[name]]}); "
                                  f"unload it first to replace it")
        t0 = time.perf_counter()
        adapter = load_adapter(name, path, self.base, self.dtype, self.max_rank)
        self._check_fits(adapter)
        adapter_id = self._next_id
        self._next_id += 1
        if self.free_slots:
            self._put(adapter_id, adapter)
        self.names[adapter_id], self.paths[adapter_id] = name, Path(path)
        self.ids[name] = adapter_id          # last: a request may name it from now on
        seconds = time.perf_counter() - t0
        log.info("LoRA adapter %s loaded at run time from %s (rank %d, %.1f ms)", name, path, adapter.config.rank,
                 seconds * 1000)
        return {"name": name, "path": str(path), "rank": adapter.config.rank, "alpha": adapter.config.alpha,
                "modules": sorted(adapter.modules), "bytes": adapter.num_bytes, "seconds": seconds}

    def unregister(self, name: str) -> None:
        """Forget an adapter and free its slot. The caller makes sure no request runs with it."""
        adapter_id = self.ids.pop(name, None)
        if adapter_id is None:
            raise AdapterNotFound(f"no LoRA adapter {name!r}; this engine serves: "
                                  f"{', '.join(sorted(self.ids)) or 'none'}")
        slot = self.loaded.pop(adapter_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.names.pop(adapter_id, None)
        self.paths.pop(adapter_id, None)
        log.info("LoRA adapter %s unloaded", name)

    def _check_fits(self, adapter: Adapter) -> None:
        """A run-time adapter must fit the pool sized at start-up: rank and modules (the message names a tensor)."""
        r = adapter.config.rank
        for layer, module in sorted(adapter.weights):
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensor = f"base_model.model.model.layers.{layer}.{part}.{module}.lora_A.weight"
            if r > self.rank:
                raise AdapterError(f"{adapter.path}: tensor {tensor} has rank {r}, over this engine's adapter pool "
                                   f"rank {self.rank} (the largest rank in lora_modules at start-up)")
            if module not in self.modules:
                raise AdapterError(f"{adapter.path}: tensor {tensor} targets {module}, which this engine's adapter "
                                   f"pool has no room for (its modules: {', '.join(self.modules)}; set by the "
                                   f"adapters in lora_modules at start-up)")

    # -- one step -----------------------------------------------------------------------------------
    def begin_step(self, row_ids: list[int]) -> LoraSegments | None:
        """Group the step's rows (adapter id per row, 0 = base) by slot, loading adapters as needed."""
        wanted = set(row_ids) - {0}
        if not wanted:
            self.segments = None
            return None
        slot_of = self.acquire(wanted)
        row_slots = [slot_of[i] if i else -1 for i in row_ids]
        seg = build_segments(row_slots, self.device, with_tensors=self.triton)
        assert seg is not None
        seg.ranks = [self.slot_rank[s] for s in seg.slots]
        seg.scales = [self.slot_scale[s] for s in seg.slots]
        if self.native is not None and not self.triton:
            seg.native = self.native.segments(seg.perm, seg.starts, seg.slots, seg.ranks, seg.scales)
        elif not self.triton and len(row_ids) <= BATCHED_MAX_ROWS:
            batched_layout(seg, len(row_ids), self.num_slots, self.dtype, self.device)
        self.segments = seg
        return seg

    def end_step(self) -> None:
        self.segments = None

    def acquire(self, ids: set[int]) -> dict[int, int]:
        """A slot for each adapter id, loading the missing ones into free or least recently used slots."""
        if len(ids) > self.num_slots:
            raise RuntimeError(f"a step needs {len(ids)} adapters but the pool has {self.num_slots} slots "
                               f"(the scheduler should have kept it to max_loaded_adapters)")
        for adapter_id in sorted(ids):
            if adapter_id in self.loaded:
                self.loaded.move_to_end(adapter_id)
                continue
            t0 = time.perf_counter()
            adapter = load_adapter(self.names[adapter_id], self.paths[adapter_id], self.base, self.dtype, self.max_rank)
            self.load_seconds += time.perf_counter() - t0
            self._put(adapter_id, adapter, keep=ids)
        return {i: self.loaded[i] for i in ids}

    def _put(self, adapter_id: int, adapter: Adapter, keep: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        if adapter.config.rank > self.rank or not adapter.modules <= set(self.modules):
            raise AdapterError(f"{adapter.path}: rank {adapter.config.rank} or modules {sorted(adapter.modules)} "
                               f"do not fit the pool (rank {self.rank}, modules {list(self.modules)})")
        if self.free_slots:
            slot = self.free_slots.pop(0)
        else:
            victim = next(i for i in self.loaded if i not in keep)
            slot = self.loaded.pop(victim)
            self.num_evictions += 1
            log.debug("LoRA adapter %s evicted from slot %d", self.names[victim], slot)
        r = adapter.config.rank
        with torch.no_grad():
            for g in self.groups:
                self.a[g][:, slot].zero_()
                self.b[g][:, slot].zero_()
            for (layer, m), (a, b) in adapter.weights.items():
                g, j, off, n = self.place[m]
                col = j * self.rank
                self.a[g][layer, slot, col:col + r].copy_(a)
                self.b[g][layer, slot, col:col + r, off:off + n].copy_(b.T)
            self.scales[slot] = adapter.config.scale
        self.slot_rank[slot] = r
        self.slot_scale[slot] = adapter.config.scale
        self.loaded[adapter_id] = slot
        self.num_loads += 1
