"""`tokenyard bench serve`: the serving benchmark (issue 14).

One load against a server that is already running (like vLLM's benchmark_serving):

    tokenyard bench serve --url http://127.0.0.1:8000 --api-key $KEY --model demo-large \
        --dataset random --num-prompts 200 --request-rate 4 [--burstiness 1] [--max-concurrency 32] \
        [--ttft-slo-ms 2000 --tpot-slo-ms 200] [--result bench/out/serve_load.json]

A scenario (it starts and stops the servers itself, one at a time; JSON + PNG in bench/out/):

    # 1. rate sweep, gateway vs static-batch baseline on the W2-shaped random Llama: Poisson
    #    arrivals held 60 s per rate, up to the first rate whose p99 TTFT misses the SLO
    tokenyard bench serve --scenario rate-sweep --w2 --rates 1,2,3 --duration-s 60 --ttft-slo-ms 5000
    #    ... or one burst of --num-prompts requests per rate (no --duration-s)
    #    ... or on a demo model (--config tokenyard/deploy/default.yaml --engine demo-large)
    tokenyard bench serve --scenario rate-sweep --engine demo-large --rates 1,2,4,8,16 --num-prompts 128
    # 2. interactive vs batch priorities under mixed load
    tokenyard bench serve --scenario priorities --engine demo-large --interactive-rate 2 --num-prompts 64
    # 3. router on vs all-large (model auto vs demo-large): accuracy and cost
    tokenyard bench serve --scenario router --num-prompts 320
    # 4. prefix-heavy chat, prefix caching on vs off
    tokenyard bench serve --scenario prefix --engine demo-large --num-prompts 128
    # 5. speculation (ngram prompt lookup) on vs off
    tokenyard bench serve --scenario speculation --engine demo-large --num-prompts 64

The fleet simulation (scaling policies over a day of traffic, docs/scaling.md "Fleet simulation"):

    tokenyard bench fleet [--peak-rps 8 --spikes 3 --wake-s 2]

Without the `tokenyard bench` registration, `python -m tokenyard.bench.serve_cli serve ...` is the same.
The key: --api-key, else env TOKENYARD_API_KEY (scenarios make their own keys).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DATASETS = ("random", "tasks", "prefix", "summarise")
SCENARIOS = ("rate-sweep", "priorities", "router", "prefix", "speculation")


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def _rates(text: str) -> list[float]:
    return [math.inf if r.strip() in ("inf", "max") else float(r) for r in text.split(",") if r.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    ap = sub.add_parser("serve", help="serving benchmark over HTTP (load generator, scenarios)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=SCENARIOS, help="run a scenario (starts its own servers)")
    g = ap.add_argument_group("one load against a running server")
    g.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    g.add_argument("--api-key", default=os.environ.get("TOKENYARD_API_KEY"), help="default: env TOKENYARD_API_KEY")
    g.add_argument("--model", default="auto", help="model name in the requests (an engine name or auto)")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    g.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    g.add_argument("--result", type=Path, help="write the summary and records as JSON here")
    c = ap.add_argument_group("shared")
    c.add_argument("--num-prompts", type=int, default=64)
    c.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1: Poisson")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--tokenizer", type=Path, help="checkpoint folder whose tokenizer sizes prompts "
                                                  "(default: the served model's, else models/demo-large)")
    c.add_argument("--input-len", type=_range, default=(32, 512), help="random dataset: prompt tokens A:B")
    c.add_argument("--output-len", type=_range, default=(16, 256), help="random dataset: max_tokens A:B")
    c.add_argument("--ttft-slo-ms", type=float, default=None, help="goodput / sweep SLO on TTFT")
    c.add_argument("--tpot-slo-ms", type=float, default=None, help="goodput SLO on TPOT")
    c.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--results-name", help="scenarios: raw results to bench/results/<name>.json "
                                          "(default serve_<scenario>)")
    c.add_argument("--no-results", action="store_true", help="scenarios: do not write bench/results/")
    s = ap.add_argument_group("scenarios")
    s.add_argument("--config", type=Path, default=ROOT / "tokenyard" / "deploy" / "default.yaml", help="gateway deployment")
    s.add_argument("--engine", default="demo-large", help="the engine measured (its model feeds the baseline)")
    s.add_argument("--w2", action="store_true", help="rate-sweep on the W2-shaped random Llama "
                                                     "(deploy/bench_w2.yaml; built on first use)")
    s.add_argument("--rates", type=_rates, default=[1.0, 2.0, 4.0, 8.0], help="comma-separated req/s (inf: all)")
    s.add_argument("--baseline-rates", type=_rates, help="rate-sweep: the baseline's rates (default --rates)")
    s.add_argument("--only-server", choices=("tokenyard", "static-batch"), help="rate-sweep: run one server only")
    s.add_argument("--duration-s", type=float, help="rate-sweep: hold each rate this long (Poisson arrivals) "
                                                    "instead of one burst of --num-prompts")
    s.add_argument("--drain-s", type=float, default=30.0, help="held rate-sweep: cancel requests still running "
                                                               "this long after the last arrival")
    s.add_argument("--batch-size", type=int, default=32, help="static-batch baseline's batch size")
    s.add_argument("--interactive-rate", type=float, default=2.0, help="priorities: interactive req/s")
    s.add_argument("--concurrency", type=int, default=8, help="router / prefix: requests in flight")
    s.add_argument("--spec-concurrency", type=int, default=1, help="speculation: requests in flight")
    ap.set_defaults(func=run)
    from tokenyard.bench.fleet import fleet_bench
    fleet = sub.add_parser("fleet", help="fleet simulation: scaling policies over a day of traffic (issue 52)",
                           description=fleet_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fleet_bench.add_arguments(fleet)
    fleet.set_defaults(func=fleet_bench.run)


def _requests(args: argparse.Namespace, dataset: str, tokenizer: Path, max_len: int | None, n: int | None = None):
    from tokenyard.bench import serve_datasets as ds
    if dataset == "tasks":
        return ds.task_suite(args.num_prompts, seed=args.seed)
    sizer = ds.TokenSizer(tokenizer)
    if dataset == "random":
        return ds.random_lengths(n or args.num_prompts, sizer, args.input_len, args.output_len, max_len,
                                 seed=args.seed)
    if dataset == "prefix":
        sys_tokens = 256 if max_len is None else min(256, max_len // 2)
        return ds.shared_prefix_chat(args.num_prompts, sizer, system_tokens=sys_tokens, seed=args.seed)
    return ds.summarisation_mix(args.num_prompts, sizer, max_model_len=max_len, seed=args.seed)


def _run_load(args: argparse.Namespace) -> int:
    from tokenyard.bench.load_generator import LoadConfig, run_load
    from tokenyard.bench.serve_datasets import max_model_len_of
    from tokenyard.bench.serving_metrics import SLO, format_summary, summarize
    if not args.url:
        print("tokenyard bench serve: give --url (a running server) or --scenario", file=sys.stderr)
        return 2
    tok = args.tokenizer or ROOT / "models" / "demo-large"
    reqs = _requests(args, args.dataset, tok, max_model_len_of(tok))
    cfg = LoadConfig(args.url, args.api_key, args.model, args.request_rate, args.burstiness, args.max_concurrency,
                     seed=args.seed, progress=not args.no_progress)
    res = run_load(reqs, cfg)
    slo = SLO(args.ttft_slo_ms, args.tpot_slo_ms) if (args.ttft_slo_ms or args.tpot_slo_ms) else None
    s = summarize(res.records, res.duration_s, slo)
    print(format_summary(f"{args.url} {args.dataset} rate {args.request_rate:g}", s))
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        records = [{k: v for k, v in asdict(r).items() if k != "text"} for r in res.records]
        args.result.write_text(json.dumps({"summary": s.to_dict(), "records": records}, indent=1, default=str))
    return 0 if s.failed == 0 else 1


def run(args: argparse.Namespace) -> int:
    if args.bench_command != "serve":
        return 2
    if not args.scenario:
        return _run_load(args)
    from tokenyard.bench import scenarios as sc
    from tokenyard.bench import serve_launch as sl
    from tokenyard.bench.results_io import RunRecorder
    recorder = RunRecorder(args.results_name or "serve_" + args.scenario.replace("-", "_"))
    opts = sc.RunOptions(out_dir=args.out_dir, seed=args.seed, burstiness=args.burstiness,
                         progress=not args.no_progress)
    deploy_dir = args.out_dir / "deploy"
    config = args.config
    engine = args.engine
    if args.w2:
        sl.serving_checkpoint(ROOT / "bench" / "out" / "w2-serve-llama")   # where deploy/bench_w2.yaml points
        config, engine = ROOT / "deploy" / "bench_w2.yaml", "w2"
    from tokenyard.gateway.config.deployment import load_deployment
    dep = load_deployment(config)
    if engine not in dep.engines:
        print(f"tokenyard bench serve: engine {engine!r} is not in {config} (has {', '.join(dep.engines)})",
              file=sys.stderr)
        return 2
    model_dir = dep.engines[engine].model
    tok = args.tokenizer or model_dir
    max_len = sc_max_len(model_dir)
    one = sl.derive_deployment(config, deploy_dir / f"{engine}.yaml", only_engines=[engine])

    if args.scenario == "rate-sweep":
        servers = {"tokenyard": sl.gateway_process(one, f"gateway-{engine}", engine),
                   f"static-batch-{args.batch_size}": sl.static_process(model_dir, args.batch_size)}
        if args.only_server:
            # One side again (e.g. after a burst of other work on the machine spoilt its run).
            servers = {n: la for n, la in servers.items() if n.startswith(args.only_server)}
        cfg = sc.SweepConfig(args.rates, args.ttft_slo_ms or 2000.0, args.tpot_slo_ms, duration_s=args.duration_s,
                             drain_s=args.drain_s, dataset_size=args.num_prompts,
                             rates_by_server={f"static-batch-{args.batch_size}": args.baseline_rates}
                             if args.baseline_rates else {})
        result = sc.rate_sweep(servers, lambda n: _requests(args, "random", tok, max_len, n), cfg, opts)
    elif args.scenario == "priorities":
        gw = sl.gateway_process(one, f"gateway-{engine}", engine, batch_key=True)
        inter = _requests(args, "tasks", tok, max_len)
        batch = _requests(args, "summarise", tok, max_len)
        result = sc.priorities(gw, inter, batch, sc.PriorityConfig(args.interactive_rate), opts)
    elif args.scenario == "router":
        full = sl.derive_deployment(config, deploy_dir / "router.yaml")
        large = dep.routing.large or engine
        result = sc.router(sl.gateway_process(full, "gateway-router"), _requests(args, "tasks", tok, max_len),
                           large, opts, args.concurrency)
    elif args.scenario == "prefix":
        off = sl.derive_deployment(config, deploy_dir / f"{engine}-noprefix.yaml", {"enable_prefix_caching": False},
                                   only_engines=[engine])
        servers = {"prefix cache on": sl.gateway_process(one, f"gateway-{engine}", engine),
                   "prefix cache off": sl.gateway_process(off, f"gateway-{engine}-noprefix", engine)}
        result = sc.prefix_chat(servers, _requests(args, "prefix", tok, max_len), opts, concurrency=args.concurrency)
    else:
        on = sl.derive_deployment(config, deploy_dir / f"{engine}-ngram.yaml", {"speculative_method": "ngram"},
                                  only_engines=[engine])
        servers = {"ngram": sl.gateway_process(on, f"gateway-{engine}-ngram", engine),
                   "none": sl.gateway_process(one, f"gateway-{engine}", engine)}
        result = sc.speculation(servers, _requests(args, "tasks", tok, max_len), opts, args.spec_concurrency)
    print(result["table"])
    if not args.no_results:
        figures, runs = raw_results(result)
        recorder.write(figures, runs, engine=engine, config=str(config.relative_to(ROOT) if config.is_relative_to(ROOT)
                                                                  else config))
    return 0


def raw_results(result: dict) -> tuple[dict, list]:
    """A scenario's result as (figures, runs) for bench/results: the per-run summaries become
    runs, everything else but the printed table stays a figure."""
    figures = {k: v for k, v in result.items() if k not in ("table", "points", "runs")}
    runs: list = []
    for server, pts in (result.get("points") or {}).items():
        runs += [{"server": server, **p} for p in pts]
    for label, r in (result.get("runs") or {}).items():
        runs.append({"run": label, **r})
    return figures, runs


def sc_max_len(model_dir: Path) -> int | None:
    from tokenyard.bench.serve_datasets import max_model_len_of
    return max_model_len_of(model_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenyard bench")
    add_arguments(ap)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
