"""A worker rank of a pipeline (x tensor) parallel engine: every rank but rank 0.

It joins the groups (tokenyard.engines.pp.dist_env), receives the engine's StageSpec from rank 0, loads its
part of the model (tokenyard.engines.pp.rank_model) and its KV cache (same block ids as rank 0's block
manager), reports readiness, and then for each step: takes the inputs (and, past stage 0, the
hidden states) from its source rank, hands the inputs on to the next stage at once, runs its
layers and sends the result on: hidden states to the next stage, or from the last stage's first
rank the logits to rank 0. It never schedules or samples: rank 0 holds all request state, so a
worker holds nothing a restart would lose. Any error ends the process, which closes its sockets,
so its peers' waits fail at once rather than hang.

Started by the engine (spawned, local) or by hand on another node with the torch.distributed
environment set (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK; LOCAL_RANK picks the GPU):

    python -m tokenyard.engines.pp.stage_worker            # serve engines until killed: rejoin after each
    python -m tokenyard.engines.pp.stage_worker --once     # serve one engine, then exit
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

REJOIN_PAUSE_S = 1.0   # between a finished engine and joining the next one


def serve(meet, rank: int, world: int, timeout_s: float, local_rank: int = 0) -> None:
    """Serve one engine's lifetime as `rank`; returns when rank 0 stops it, raises on failure.
    meet: an init method (tcp://...) or the store of the engine's generation."""
    # Imported here: a spawned interpreter pays only for what the worker uses.
    from tokenyard.engines.model.attention import AttentionMetadata
    from tokenyard.engines.pp.dist_env import READY, RankLayout, join, stage_groups
    from tokenyard.engines.pp.rank_model import allocate_stage_kv, device_for, load_rank_model
    from tokenyard.engines.pp.stage_link import STATS, STOP, StageLink, decode
    from tokenyard.engines.pp.stage_split import stage_forward

    ctrl = join(meet, rank, world, timeout_s)
    try:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        spec = box[0]
        layout = RankLayout(spec.tp, spec.pp)
        if layout.world != world:
            raise RuntimeError(f"rank 0 runs tp {spec.tp} x pp {spec.pp} = {layout.world} ranks, "
                               f"but WORLD_SIZE is {world}")
        groups = stage_groups(ctrl, layout, rank, spec.device, spec.timeout_s)
        status = READY
        try:
            device = device_for(spec.device, local_rank)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            model, cfg, part = load_rank_model(spec, rank, device, groups.tp)
            kv = allocate_stage_kv(model, cfg, part, spec, device)
        except Exception:  # noqa: BLE001 - tell rank 0 why, then exit
            status = f"rank {rank} (stage {layout.coords(rank)[0]}) failed to start:\n{traceback.format_exc()}"
        statuses: list = [None] * world
        dist.all_gather_object(statuses, status)
        if status != READY or any(s != READY for s in statuses):
            raise RuntimeError(status if status != READY else "another rank failed to start")
        dtype = getattr(torch, spec.dtype)
        link = StageLink(ctrl, groups.data, device, dtype, cfg.hidden_size, cfg.vocab_size)
        src, dst = layout.source(rank), layout.successor(rank)
        sends_logits = part.last and rank == layout.logits_rank
        # Seconds in this stage's forward (wall and this thread's CPU), since the last STATS request.
        busy, busy_cpu, since = 0.0, 0.0, time.perf_counter()
        while True:
            nbytes, num_tokens = link.recv_header(src)
            if nbytes == STOP:
                if dst is not None:
                    link.send_stop(dst)
                break
            if nbytes == STATS:
                if dst is not None:
                    link.send_stats_request(dst)
                now = time.perf_counter()
                link.send_stats(busy, now - since, busy_cpu)
                busy, busy_cpu, since = 0.0, 0.0, now
                continue
            payload = link.recv_payload(src, nbytes)
            if dst is not None:   # the next stage can take its inputs while this one computes
                link.send_inputs(dst, payload, num_tokens)
            inputs = decode(payload)
            x = (torch.tensor(inputs.ids, dtype=torch.long, device=device) if part.first
                 else link.recv_hidden(src, num_tokens))
            meta = AttentionMetadata.build(inputs.slots, inputs.query_lens, inputs.seq_lens, inputs.tables,
                                           spec.block_size, cfg.sliding_window, device, spec.attention_backend)
            t0, c0 = time.perf_counter(), time.thread_time()
            out = stage_forward(model, part, x, torch.tensor(inputs.positions, dtype=torch.long, device=device),
                                meta, kv, torch.tensor(inputs.logits_rows, dtype=torch.long, device=device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)   # busy time is the GPU's, not the launch's
            busy += time.perf_counter() - t0
            busy_cpu += time.thread_time() - c0
            if dst is not None:
                link.send_hidden(dst, out)
            elif sends_logits:
                link.send_logits(0, out)
        link.outbox.flush()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawned_main(init_method: str, rank: int, world: int, timeout_s: float, threads: int) -> None:
    """Entry of a worker the engine spawned on this machine (one GPU per rank on CUDA)."""
    torch.set_num_threads(threads)
    try:
        serve(init_method, rank, world, timeout_s, local_rank=rank)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # noqa: BLE001 - exit non-zero; rank 0 names the rank
        print(f"pipeline worker rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    from tokenyard.engines.pp.dist_env import DistEnv, worker_store

    ap = argparse.ArgumentParser(description="A worker rank (1..WORLD_SIZE-1) of a pipeline/tensor-parallel "
                                             "Tokenyard engine, found through MASTER_ADDR, MASTER_PORT, "
                                             "WORLD_SIZE and RANK.")
    ap.add_argument("--once", action="store_true", help="serve one engine, then exit (default: rejoin)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for rank 0 and the other ranks at each start-up (default 600)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = DistEnv.from_environ()
    if env is None:
        ap.error("set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK (torchrun and Kubernetes jobs do)")
    if env.rank == 0:
        ap.error("RANK 0 is the engine process (the gateway or replica server), not a worker")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    served = 0   # the last engine generation this worker took part in (dist_env.engine_store)
    while True:
        try:
            store, served = worker_store(env, served, args.timeout)
            log.info("rank %d: joining engine generation %d", env.rank, served)
            serve(store, env.rank, env.world_size, args.timeout, local_rank)
            log.info("rank %d: engine stopped", env.rank)
        except Exception as exc:  # noqa: BLE001 - the engine died or restarted: rejoin its successor
            log.warning("rank %d: %s: %s", env.rank, type(exc).__name__, exc)
            if args.once:
                return 1
        if args.once:
            return 0
        time.sleep(REJOIN_PAUSE_S)


if __name__ == "__main__":
    raise SystemExit(main())
