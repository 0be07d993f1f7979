"""`tokenyard router`: the learned router's offline commands (tokenyard/router_models/training/cli.py:
train, eval) and the ones that read the deployment's Redis (learning from traffic, docs/router.md):

    tokenyard router train --from-traffic [--tenant T]... [--traffic-weight 8 | --traffic-only] [--out FILE]
        the labels clients' feedback and judges left in Redis (every tenant's, or those named),
        with the demo labels (weighted) or alone -> a new artifact, its evaluation, published to Redis
    tokenyard router import-labels FILE --tenant T    a judge's verdicts (JSONL) as labels
    tokenyard router judge --tenant T --sample N --key K    the large engine grades small-engine answers
                                                      (tokenyard/cli/router_judge.py)
    tokenyard router publish FILE                     an artifact to Redis; prints its ref (sha256:...)
    tokenyard router shadow-report [--candidate REF] [--tenant T] [--json]
    tokenyard router labels [--tenant T]              label counts per tenant

Promotion is a policy change: put the ref under `router.artifact` (or `router.shadow` to shadow it)
and `tokenyard policy apply` it; `tokenyard policy rollback N` undoes it like any other change.
Redis is found as `tokenyard policy` finds it (--redis-url, REDIS_URL, the deployment's, the embedded one).

Judge files for import-labels, one JSON object a line, either
    {"response_id": "chatcmpl-...", "preferred_engine": "demo-large"}   (or "score": 0..1, the answer's grade)
joined with the response kept for feedback, exactly as POST /v1/feedback does, or
    {"prompt": "...", "label": 0 | 1, "prompt_tokens": 17}   (1: the small engine is enough; prompt_tokens
counted with --tokenizer when absent), a label for a prompt of the judge's own sample.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from tokenyard.cli.router_redis import redis_args as _redis_args
from tokenyard.cli.router_redis import store_of as _store
from tokenyard.cli.router_redis import with_redis as _with_redis
from tokenyard.router_models.training import cli as training_cli


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = training_cli.add_arguments(ap)
    tr = sub.choices["train"]
    tr.add_argument("--from-traffic", action="store_true",
                    help="train on the labels in the deployment's Redis (POST /v1/feedback, import-labels)")
    tr.add_argument("--tenant", action="append", default=[], help="with --from-traffic: this tenant's labels "
                    "(repeatable; default: every tenant's)")
    tr.add_argument("--traffic-weight", type=int, default=None,
                    help="with --from-traffic: each traffic label counts this many times beside the demo labels "
                         "(default: traffic_labels.DEFAULT_TRAFFIC_WEIGHT)")
    tr.add_argument("--traffic-only", action="store_true",
                    help="with --from-traffic: the traffic labels alone, without the demo labels")
    tr.add_argument("--no-publish", action="store_true", help="with --from-traffic: do not publish the artifact")
    _redis_args(tr)
    tr.set_defaults(func=run_train)
    imp = sub.add_parser("import-labels", help="a judge's JSONL verdicts as labels in Redis")
    imp.add_argument("file")
    imp.add_argument("--tenant", required=True, help="the tenant the labels belong to")
    imp.add_argument("--tokenizer", default=str(training_cli.ROOT / "models" / "demo-small"),
                     help="checkpoint folder whose tokenizer counts prompts that lack prompt_tokens")
    _redis_args(imp)
    imp.set_defaults(func=run_import)
    pub = sub.add_parser("publish", help="publish an artifact to Redis (the policy names it by its ref)")
    pub.add_argument("file")
    _redis_args(pub)
    pub.set_defaults(func=run_publish)
    rep = sub.add_parser("shadow-report", help="how the shadow candidate would have routed the scored requests")
    rep.add_argument("--candidate", help="artifact ref (default: the current policy's router.shadow)")
    rep.add_argument("--tenant", help="one tenant's requests only")
    rep.add_argument("--json", action="store_true")
    _redis_args(rep)
    rep.set_defaults(func=run_shadow_report)
    lab = sub.add_parser("labels", help="label counts per tenant")
    lab.add_argument("--tenant")
    _redis_args(lab)
    lab.set_defaults(func=run_labels)
    from tokenyard.cli.router_judge import add_judge
    add_judge(sub, _redis_args)


# -- train --from-traffic ------------------------------------------------------------------------
def run_train(args: argparse.Namespace) -> int:
    if not args.from_traffic:
        if args.tenant or args.traffic_weight is not None or args.traffic_only or args.no_publish:
            print("tokenyard router train: --tenant, --traffic-weight, --traffic-only and --no-publish go with "
                  "--from-traffic", file=sys.stderr)
            return 2
        return training_cli.run_train(args)
    if args.traffic or args.engine or Path(args.labels).is_file():
        print("tokenyard router train: --from-traffic trains on the Redis labels (with the demo label folder "
              "--labels); not with --traffic, --engine or a judgement file", file=sys.stderr)
        return 2
    if args.out == str(training_cli.ARTIFACT):      # never overwrite the packaged demo artifact
        args.out = "router_traffic.json"
    return _with_redis(args, lambda client, dep: _train_from_traffic(args, client, dep))


async def _current_router(client: Any, dep: Any) -> tuple[str, Any]:
    """(its name, the two-engine Artifact) of the router in force: the policy's, else the deployment's."""
    from tokenyard.gateway.policy.store import PolicyStore
    from tokenyard.gateway.routing.artifact_store import ArtifactStore
    from tokenyard.router_models.runtime.artifact import load
    cur = await PolicyStore(client, dep.redis_prefix).current()
    ref = cur.policy().router.artifact if cur is not None else None
    if ref is not None:
        return ref, await ArtifactStore(client, dep.redis_prefix).load(ref)
    path = dep.router.artifact if dep.router is not None else None
    if path is None:
        return "none", None
    try:
        return str(path), load(path)
    except Exception:  # noqa: BLE001 - an N-engine deployment artifact: no two-engine comparison
        return str(path), None


async def _train_from_traffic(args: argparse.Namespace, client: Any, dep: Any) -> int:
    from tokenyard.gateway.routing.artifact_store import ArtifactStore
    from tokenyard.router_models.runtime.artifact import ArtifactError, save
    from tokenyard.router_models.runtime.scorer import Scorer
    from tokenyard.router_models.training.evaluation import evaluate
    from tokenyard.router_models.training.traffic_labels import (
        DEFAULT_TRAFFIC_WEIGHT,
        agreement,
        label_rows,
        traffic_training_set,
    )
    from tokenyard.router_models.training.train import DEFAULT_C, load_labels, train_router

    store = _store(client, dep)
    tenants = args.tenant or await store.tenants()
    labels = []
    for tenant in tenants:
        labels += list((await store.labels(tenant)).values())
    rows = label_rows(labels)
    weight = DEFAULT_TRAFFIC_WEIGHT if args.traffic_weight is None else args.traffic_weight
    folder = Path(args.labels)
    try:
        demo = (None, None) if args.traffic_only else (load_labels(folder / "train.jsonl"),
                                                        load_labels(folder / "calibration.jsonl"))
        train, cal, info = traffic_training_set(rows, demo[0], demo[1], weight)
        art, _ = train_router(train, cal, C=DEFAULT_C if args.C is None else args.C,
                              target_large_share=args.target_large_share, target_quality=args.target_quality,
                              training={"source": "traffic", "tenants": sorted(tenants), **info},
                              labels="small_enough")
    except (OSError, ValueError) as e:
        print(f"tokenyard router train: {e}", file=sys.stderr)
        return 2
    save(art, args.out)
    print(f"wrote {args.out}: {len(labels)} labels of {len(tenants)} tenant(s), {len(rows)} with a 0/1 label "
          f"({info['traffic_label_1']} small enough); {len(train)} train / {len(cal)} calibration rows "
          f"({info['base']} base{', weight ' + str(weight) if info['base'] == 'demo' else ''}); threshold "
          f"{art.threshold:.4f} ({art.threshold_method} {art.threshold_target})")
    new = Scorer(art)
    print(f"traffic labels matched by the new router: {agreement(lambda t, n: new.goes_large(new.score(t, n)), rows):.3f}")
    try:
        name, current = await _current_router(client, dep)
    except ArtifactError as e:
        name, current = str(e), None
    if current is not None:
        old = Scorer(current)
        print(f"traffic labels matched by the router in force ({name}): "
              f"{agreement(lambda t, n: old.goes_large(old.score(t, n)), rows):.3f}")
    test = folder / "test.jsonl"
    if test.is_file():
        report, _ = evaluate(art, load_labels(test), resamples=0)   # `tokenyard router eval` for the CIs
        print(training_cli.format_summary(report))
    if not args.no_publish:
        ref = await ArtifactStore(client, dep.redis_prefix).publish(Path(args.out).read_text(encoding="utf-8"))
        print(f"published {ref}\nshadow it: router.shadow: {ref}   promote it: router.artifact: {ref}   "
              "(in the policy, then `tokenyard policy apply`)")
    return 0


# -- import-labels ------------------------------------------------------------------------------
def run_import(args: argparse.Namespace) -> int:
    from tokenyard.router_models.training.train import read_jsonl
    try:
        rows = read_jsonl(args.file)
        direct = [r for r in rows if isinstance(r, dict) and "prompt" in r]
        training_cli._count_missing(direct, args.tokenizer)
    except (OSError, ValueError) as e:
        print(f"tokenyard router import-labels: {e}", file=sys.stderr)
        return 2
    return _with_redis(args, lambda client, dep: _import(args, rows, client, dep))


async def _import(args: argparse.Namespace, rows: list[Any], client: Any, dep: Any) -> int:
    import time

    from tokenyard.gateway.edge.errors import APIError
    from tokenyard.gateway.http.feedback_endpoint import label_for, parse_feedback, request_id_of
    store = _store(client, dep)
    stored = problems = 0
    for n, r in enumerate(rows, 1):
        where = f"{args.file}:{n}"
        try:
            if not isinstance(r, dict):
                raise ValueError("not a JSON object")
            if "prompt" in r:
                label, prompt, tokens = r.get("label"), r["prompt"], r.get("prompt_tokens")
                if label not in (0, 1) or not isinstance(prompt, str) or not isinstance(tokens, int) or tokens < 0:
                    raise ValueError("a prompt line needs prompt (text), label (0 or 1) and prompt_tokens >= 0")
                rid = "import-" + hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:32]
                entry = {"prompt": prompt, "prompt_tokens": tokens, "label": label, "source": "import",
                         "time": time.time()}
            else:
                rid, score, preferred = parse_feedback(r)
                sample = await store.sample(args.tenant, request_id_of(rid))
                if sample is None:
                    raise ValueError(f"no response {rid!r} of tenant {args.tenant!r} was kept for feedback")
                label = label_for(sample, score, preferred)
                rid = request_id_of(rid)
                entry = {"prompt": sample["prompt"], "prompt_tokens": sample["prompt_tokens"],
                         "engine": sample["engine"], "small": sample["small"], "large": sample["large"],
                         "router_score": sample.get("score"), "score": score, "preferred_engine": preferred,
                         "label": label, "source": "judge", "time": time.time()}
        except (ValueError, KeyError, APIError) as e:
            print(f"{where}: {getattr(e, 'message', None) or e}", file=sys.stderr)
            problems += 1
            continue
        await store.put_label(args.tenant, rid, entry)
        stored += 1
    print(f"stored {stored} labels for tenant {args.tenant}; {problems} lines refused")
    return 0 if not problems else 1


# -- publish, shadow-report, labels -------------------------------------------------------------
def run_publish(args: argparse.Namespace) -> int:
    from tokenyard.router_models.runtime.artifact import ArtifactError
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"tokenyard router publish: {args.file}: {e}", file=sys.stderr)
        return 2

    async def work(client: Any, dep: Any) -> int:
        from tokenyard.gateway.routing.artifact_store import ArtifactStore
        try:
            ref = await ArtifactStore(client, dep.redis_prefix).publish(text)
        except ArtifactError as e:
            print(f"tokenyard router publish: {args.file}: {e}", file=sys.stderr)
            return 1
        print(ref)
        return 0
    return _with_redis(args, work)


def run_shadow_report(args: argparse.Namespace) -> int:
    async def work(client: Any, dep: Any) -> int:
        from tokenyard.gateway.policy.store import PolicyStore
        from tokenyard.gateway.routing.shadow_tally import read_report
        candidate = args.candidate
        if candidate is None:
            cur = await PolicyStore(client, dep.redis_prefix).current()
            candidate = cur.policy().router.shadow if cur is not None else None
        if not candidate:
            print("tokenyard router shadow-report: the current policy sets no router.shadow; name one with "
                  "--candidate REF", file=sys.stderr)
            return 1
        report = await read_report(client, dep.redis_prefix, candidate, args.tenant)
        if args.json:
            print(json.dumps(report, indent=2))
            return 0
        print(f"candidate {candidate}" + (f", tenant {args.tenant}" if args.tenant else ""))
        print("| router in force | tenant | requests | agreement | large now | large with candidate | "
              "to large | to small | predicted shortfall now / candidate |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in [*report["rows"], {"current": "all", "tenant": "all", **report["total"]}]:
            if not row["requests"]:
                continue
            print(f"| {row['current'][:19]} | {row['tenant']} | {row['requests']} | {row['agreement']:.3f} | "
                  f"{row['current_large_share']:.3f} | {row['candidate_large_share']:.3f} | {row['to_large']} | "
                  f"{row['to_small']} | {row['current_predicted_shortfall']:.2f} / "
                  f"{row['candidate_predicted_shortfall']:.2f} |")
        return 0
    return _with_redis(args, work)


def run_labels(args: argparse.Namespace) -> int:
    async def work(client: Any, dep: Any) -> int:
        store = _store(client, dep)
        for tenant in [args.tenant] if args.tenant else await store.tenants():
            labels = list((await store.labels(tenant)).values())
            ones = sum(1 for v in labels if v.get("label") == 1)
            zeros = sum(1 for v in labels if v.get("label") == 0)
            print(f"{tenant}: {len(labels)} labels ({ones} small enough, {zeros} large needed, "
                  f"{len(labels) - ones - zeros} without signal)")
        return 0
    return _with_redis(args, work)
