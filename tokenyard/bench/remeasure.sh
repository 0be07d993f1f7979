#!/usr/bin/env bash
# Re-run the CPU benchmarks behind bench/RESULTS.md, one at a time (two at once on a 2-core
# machine would measure each other), each writing its raw output to bench/results/<name>.json
# and its log to bench/out/logs/<step>.log. A step that fails or runs past its time limit is
# reported and the rest still run.
#
#   tokenyard/bench/remeasure.sh                 # every step below, in order
#   tokenyard/bench/remeasure.sh kernel w2prof   # only the named steps
#
# The serving rate sweep (Poisson arrivals held 60 s per rate) is the first step: ~15 minutes.
# sweep_static runs the baseline's side of it alone (e.g. again after other work spoilt it).
set -u
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
mkdir -p bench/out/logs

declare -A CMD=(
  [sweep]="$PY -m tokenyard.bench.serve_cli serve --scenario rate-sweep --w2 --rates 2,3,4,5,6 --baseline-rates 0.0625,0.125,0.25,0.5 --duration-s 60 --drain-s 30 --ttft-slo-ms 5000 --no-progress --results-name serve_rate_sweep_held_2"
  [sweep_static]="$PY -m tokenyard.bench.serve_cli serve --scenario rate-sweep --w2 --rates 2,3,4,5,6 --baseline-rates 0.0625,0.125,0.25,0.5 --only-server static-batch --duration-s 60 --drain-s 30 --ttft-slo-ms 5000 --no-progress --results-name serve_rate_sweep_held_static"
  [router]="$PY -m tokenyard.bench.router_eval"
  [routerlat]="$PY -m tokenyard.bench.router_latency --rounds 5"
  [kernel]="$PY -m tokenyard.bench.kernel_micro --reps 30 --rounds 5"
  [kernel_t1]="$PY -m tokenyard.bench.kernel_micro --reps 30 --rounds 5 --threads 1"
  [sched]="$PY -m tokenyard.bench.scheduler_bench --only prefill waste ttft stutter"
  [sched_timing]="$PY -m tokenyard.bench.scheduler_bench --only prefill ttft stutter"
  [w2prof]="$PY -m tokenyard.bench.w2_profile"
  [w2]="$PY -m tokenyard.bench.w2_throughput --runs 3"
  [quant]="$PY -m tokenyard.bench.quant_bench --out bench/out/quant.json"
  [qprefill]="$PY -m tokenyard.bench.quant_prefill"
  [qprefill_packed]="$PY -m tokenyard.bench.quant_prefill --packed-int8"
  [overhead]="$PY -m tokenyard.bench.gateway_overhead"
  [overload]="$PY -m tokenyard.bench.admission_overload"
  [replica]="$PY -m tokenyard.bench.replica_prefix_bench"
  [spec]="$PY -m tokenyard.bench.spec_bench --items 32 --per-task 8 --k 4 --repeats 3"
  [spec_tasks]="$PY -m tokenyard.bench.spec_bench --items 32 --per-task 8 --k 4 --repeats 5 --batches --results-name spec_bench_k4_tasks"
  [spec8]="$PY -m tokenyard.bench.spec_bench --items 32 --per-task 8 --k 8 --repeats 3 --batches --tasks copy --results-name spec_bench_k8_copy"
  [priorities]="$PY -m tokenyard.bench.serve_cli serve --scenario priorities --engine demo-large --interactive-rate 2 --num-prompts 64 --no-progress"
  [srouter]="$PY -m tokenyard.bench.serve_cli serve --scenario router --num-prompts 320 --concurrency 8 --no-progress"
  [prefix]="$PY -m tokenyard.bench.serve_cli serve --scenario prefix --engine demo-large --num-prompts 128 --no-progress"
  [speculation]="$PY -m tokenyard.bench.serve_cli serve --scenario speculation --engine demo-large --num-prompts 64 --spec-concurrency 1 --no-progress"
  [demo]="$PY -m tokenyard.bench.demo_eval --items 640"
)
# Priority order: the serving sweep, the figures that had no script before, then the rest.
ORDER=(sweep router w2prof kernel kernel_t1 sched routerlat overhead overload priorities srouter prefix speculation
       quant qprefill qprefill_packed w2 demo replica spec spec_tasks spec8)
LIMIT=1500   # seconds per step

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=("${ORDER[@]}")
for step in "${steps[@]}"; do
  cmd=${CMD[$step]:-}
  if [ -z "$cmd" ]; then echo "unknown step $step (known: ${ORDER[*]})"; exit 2; fi
  echo "$(date -u +%H:%M:%S) $step: $cmd (load $(cut -d' ' -f1-3 /proc/loadavg))"
  timeout "$LIMIT" $cmd > "bench/out/logs/$step.log" 2>&1
  echo "$(date -u +%H:%M:%S) $step: exit $?"
done
