"""Rank 0 of a pipeline (x tensor) parallel engine: starts or meets the workers, runs stage 0
and sends each batch down the pipeline, receives the logits and samples.

    runner.submit(batch) -> InFlight     run stage 0, hand the batch to stage 1 (returns at once)
    runner.collect(flight) -> tokens     wait for the batch's logits from the last stage, sample
    runner.execute(batch) / forward()    both in one call (no micro-batching)
    runner.stage_stats()                 per rank: (busy seconds, window, busy CPU seconds)

Several batches may be in flight (tokenyard.engines.pp.micro_batches keeps up to P); they leave the
pipeline in the order they entered it.

Failure: a stage that dies closes its sockets, so the next send or receive that involves it
fails at once, or at worst after tp_timeout_s. Workers this process spawned are then checked,
so the error names the dead stage and its exit code; with workers on other nodes, it names the
rank whose link failed. The engine fails every in-flight request with that message.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.scheduler import SchedulerOutput
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model.attention import AttentionMetadata
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.model_runner import ModelRunner, StepInputs
from tokenyard.engines.model.runner_config import RunnerConfig
from tokenyard.engines.pp.dist_env import READY, DistEnv, RankLayout, engine_store, join, stage_groups
from tokenyard.engines.pp.rank_model import StageSpec, allocate_stage_kv, load_rank_model
from tokenyard.engines.pp.stage_link import StageLink, encode
from tokenyard.engines.pp.stage_split import StagePart, stage_forward, stage_layers

DEATH_GRACE_S = 2.0   # how long a failed op waits for a dead worker to be reaped, to name it

log = logging.getLogger(__name__)


def uses_pipeline(cfg: EngineConfig) -> bool:
    """Whether the engine runs through this package: pipeline stages, quantised tensor
    parallelism (its sharding lives here), or any multi-rank engine whose ranks meet through the
    torch.distributed environment. Plain local tensor parallelism keeps tokenyard.engines.tp."""
    if cfg.pipeline_parallel_size > 1:
        return True
    if cfg.tensor_parallel_size > 1:
        return cfg.quantization != "none" or DistEnv.from_environ() is not None
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """The other ranks as this process sees them: spawned processes, or remote ranks."""

    def __init__(self, layout: RankLayout, timeout_s: float, env: DistEnv | None) -> None:
        self.layout = layout
        self.procs: dict[int, mp.Process] = {}
        self.remote = env is not None
        if env is not None:
            if env.rank != 0:
                raise EngineDeadError(f"RANK is {env.rank}: ranks 1.. run `python -m tokenyard.engines.pp.stage_worker`, "
                                      f"only rank 0 runs the engine")
            if env.world_size != layout.world:
                raise EngineDeadError(f"WORLD_SIZE is {env.world_size} but tensor_parallel_size {layout.tp} x "
                                      f"pipeline_parallel_size {layout.pp} needs {layout.world} ranks")
            self.env = env
            return
        self.env = None
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        # Imported here: `python -m tokenyard.engines.pp.stage_worker` then runs a module nothing imported yet.
        from tokenyard.engines.pp.stage_worker import spawned_main

        ctx = mp.get_context("spawn")   # fork would copy rank 0's threads and torch state
        threads = max(1, (os.cpu_count() or 1) // layout.world)
        for rank in range(1, layout.world):
            proc = ctx.Process(target=spawned_main, args=(self.init_method, rank, layout.world, timeout_s, threads),
                               daemon=True, name=f"tokenyard-pp{rank}")
            proc.start()
            self.procs[rank] = proc

    def name(self, rank: int) -> str:
        stage, tp_rank = self.layout.coords(rank)
        tp = f", tensor-parallel rank {tp_rank}" if self.layout.tp > 1 else ""
        return f"pipeline stage {stage} (rank {rank}{tp})"

    def check_alive(self) -> None:
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                raise EngineDeadError(f"{self.name(rank)} died (exit code {proc.exitcode})")

    def blame(self, exc: BaseException, peer: int | None) -> EngineDeadError:
        """The error that names who failed: a spawned rank seen dead, else the peer of the failed op."""
        deadline = time.monotonic() + (DEATH_GRACE_S if self.procs else 0)
        while True:
            try:
                self.check_alive()
            except EngineDeadError as dead:
                return dead
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        who = self.name(peer) if peer is not None else "a pipeline rank"
        return EngineDeadError(f"{who} is unreachable (link failed: {type(exc).__name__}: {exc})")

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@dataclass(slots=True)
class InFlight:
    """A batch inside the pipeline."""

    batch: SchedulerOutput
    sampled: list[Sequence]
    logits: torch.Tensor | None = None      # set at once when rank 0 is also the last stage
    submitted: float = field(default_factory=time.perf_counter)


class PipelineRunner(ModelRunner):
    """A ModelRunner for rank 0 whose forward spans every stage."""

    def __init__(self, cfg: EngineConfig, spec: StageSpec, device: torch.device) -> None:
        self.layout = RankLayout(spec.tp, spec.pp)
        self.spec = spec
        self.timeout_s = spec.timeout_s
        env = DistEnv.from_environ()
        self.workers = Workers(self.layout, spec.timeout_s, env)
        self.closed = False
        try:
            self._start(device)
        except BaseException as exc:
            self.close()
            if isinstance(exc, EngineDeadError):
                raise
            if isinstance(exc, (RuntimeError, OSError)):
                raise self.workers.blame(exc, None) from exc
            raise

    def _start(self, device: torch.device) -> None:
        spec, layout = self.spec, self.layout
        env = self.workers.env
        meet = engine_store(env, spec.timeout_s)[0] if env is not None else self.workers.init_method
        ctrl = join(meet, 0, layout.world, spec.timeout_s)
        dist.broadcast_object_list([spec], src=0)
        groups = stage_groups(ctrl, layout, 0, spec.device, spec.timeout_s)
        status = READY
        try:
            model, cfg, part = load_rank_model(spec, 0, device, groups.tp)
            kv = allocate_stage_kv(model, cfg, part, spec, device)
        except BaseException as exc:
            status = f"rank 0 failed to start: {exc}"
            statuses: list = [None] * layout.world
            dist.all_gather_object(statuses, status)   # let the workers exit cleanly
            raise
        statuses = [None] * layout.world
        dist.all_gather_object(statuses, status)
        for rank, s in enumerate(statuses):
            if s != READY:
                raise EngineDeadError(f"{self.workers.name(rank)} failed to start: {s}")
        super().__init__(model, kv, device, RunnerConfig(spec.block_size, spec.attention_backend))
        # Rank 0's stage compute (wall and thread-CPU seconds) since the last stage_stats call.
        self._busy, self._busy_cpu, self._since = 0.0, 0.0, time.perf_counter()
        self.model_config = cfg
        self.part: StagePart = part
        self.link = StageLink(ctrl, groups.data, device, getattr(torch, spec.dtype), cfg.hidden_size,
                              cfg.vocab_size)

    # -- the pipeline ----------------------------------------------------------------------
    def submit(self, batch: SchedulerOutput) -> InFlight:
        inputs, sampled = self.prepare(batch)
        return InFlight(batch, sampled, self._send(inputs))

    def collect(self, flight: InFlight) -> list[int]:
        logits = flight.logits if flight.logits is not None else self._receive(len(flight.sampled))
        return self._sample(logits, flight.sampled) if flight.sampled else []

    def execute(self, batch: SchedulerOutput) -> list[int]:
        return self.collect(self.submit(batch))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        logits = self._send(inputs)
        return logits if logits is not None else self._receive(len(inputs.logits_rows))

    def _send(self, inputs: StepInputs) -> torch.Tensor | None:
        """Run stage 0 on `inputs` and hand them on; the logits when rank 0 is the last stage."""
        if self.closed:
            raise EngineDeadError("the pipeline is closed")
        self.workers.check_alive()
        layout, link, dev = self.layout, self.link, self.device
        payload = encode(inputs)
        peer = None
        try:
            for peer in self._direct_peers():
                link.send_inputs(peer, payload, len(inputs.ids))
            peer = None
            t0, c0 = time.perf_counter(), time.thread_time()
            meta = AttentionMetadata.build(inputs.slots, inputs.query_lens, inputs.seq_lens, inputs.tables,
                                           self.block_size, self.sliding_window, dev, self.attention_backend)
            out = stage_forward(self.model, self.part, torch.tensor(inputs.ids, dtype=torch.long, device=dev),
                                torch.tensor(inputs.positions, dtype=torch.long, device=dev), meta, self.kv_caches,
                                torch.tensor(inputs.logits_rows, dtype=torch.long, device=dev))
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self._busy += time.perf_counter() - t0
            self._busy_cpu += time.thread_time() - c0
            peer = layout.successor(0)
            if peer is None:
                return out
            link.send_hidden(peer, out)
            return None
        except RuntimeError as exc:   # gloo/nccl: a peer closed its socket, or the timeout passed
            raise self.workers.blame(exc, peer) from exc

    def _receive(self, rows: int) -> torch.Tensor:
        src = self.layout.logits_rank
        try:
            buf = self.link.recv_logits(src, rows, self.timeout_s)
            self.link.outbox.prune()
        except RuntimeError as exc:
            raise self.workers.blame(exc, src) from exc
        return buf

    def stage_stats(self) -> list[tuple[float, float, float]]:
        """Per rank, (seconds computing its stage's layers, seconds since the previous call, the
        thread-CPU seconds of that compute): 1 - busy / window is the rank's idle fraction (the
        pipeline bubble); busy CPU well below busy wall means the rank waited for a core. Call
        between batches (with none in flight): the request travels behind every step sent."""
        now = time.perf_counter()
        out = [(self._busy, now - self._since, self._busy_cpu)]
        self._busy, self._busy_cpu, self._since = 0.0, 0.0, now
        try:
            for peer in self._direct_peers():
                self.link.send_stats_request(peer)
            out += [self.link.recv_stats(rank) for rank in range(1, self.layout.world)]
        except RuntimeError as exc:
            raise self.workers.blame(exc, None) from exc
        return out

    def _direct_peers(self) -> list[int]:
        """The ranks rank 0 sends each step to: its tensor-parallel peers and stage 1's first rank."""
        succ = self.layout.successor(0)
        return self.layout.stage_ranks(0)[1:] + ([succ] if succ is not None else [])

    def close(self) -> None:
        """Stop the workers (a stop message down the pipeline, then by force) and leave the groups."""
        if self.closed:
            return
        self.closed = True
        link = getattr(self, "link", None)
        if link is not None:
            try:
                for peer in self._direct_peers():
                    link.send_stop(peer)
                link.outbox.flush(timeout_s=DEATH_GRACE_S)
            except RuntimeError:
                pass   # a dead peer: the others fail their waits and exit
        self.workers.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse a clean exit
                log.warning("pipeline process group did not shut down cleanly", exc_info=True)


def start_pipeline(cfg: EngineConfig, model_dir: str, dtype: torch.dtype, device: torch.device,
                   max_model_len: int, num_blocks: int) -> PipelineRunner:
    """Start (or meet) the workers and load rank 0's part: the engine's runner."""
    stage_layers(ModelConfig.from_dir(model_dir).num_layers, cfg.pipeline_parallel_size)  # fail before spawning
    spec = StageSpec(tp=cfg.tensor_parallel_size, pp=cfg.pipeline_parallel_size, model_dir=str(model_dir),
                     dtype=str(dtype).removeprefix("torch."), device=device.type, max_model_len=max_model_len,
                     num_blocks=num_blocks, block_size=cfg.block_size, kv_cache_dtype=cfg.kv_cache_dtype,
                     attention_backend=cfg.attention_backend, quantization=cfg.quantization,
                     quant_group_size=cfg.quant_group_size, timeout_s=float(cfg.tp_timeout_s), progress=cfg.progress)
    return PipelineRunner(cfg, spec, device)
