#!/usr/bin/env bash
# Regenerate every figure of docs/benchmarks.md on this machine (about 15-20 minutes on 2 CPU
# cores): the control-plane benchmark, the pattern comparison on the ~100M preset, and the
# other engineers' benchmark scripts where they exist. Results land in $BENCH_OUT
# (default bench_results/), plots in docs/img/, tables inside docs/benchmarks.md.
#
#   scripts/bench_all.sh                 # everything
#   BENCH_ONLY=control-plane scripts/bench_all.sh
#   BENCH_ONLY=patterns scripts/bench_all.sh
#   BENCH_ONLY=capacity scripts/bench_all.sh
#   BENCH_ONLY=mlc-relay scripts/bench_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
out="${BENCH_OUT:-bench_results}"
only="${BENCH_ONLY:-all}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out" docs/img

if [[ "$only" == all || "$only" == control-plane ]]; then
  echo "== control plane (tiny engines; direct / router / gateway at 1, 64, 256 streams)"
  "$python" -m bench.control_plane --concurrency 1 64 256 --prompt-len 16 --output-len 32 \
    --requests-per-stream 1 --min-requests 16 --rounds 3 --out "$out/control_plane"
  cp "$out/control_plane/control_plane.png" docs/img/control_plane.png
  "$python" -m bench.docs_update --doc docs/benchmarks.md \
    "control-plane=$out/control_plane/table.md:$out/control_plane/control_plane.json"
fi

if [[ "$only" == all || "$only" == patterns ]]; then
  echo "== pattern comparison (llama-100m, CPU)"
  "$python" -m bench.patterns --model llama-100m --rates 0.1 0.2 0.4 --duration-s 40 --min-prompts 4 \
    --input-len normal:256,32 --output-len 16 --out "$out/patterns"
  cp "$out/patterns/latency_vs_load.png" docs/img/patterns_latency_vs_rate.png
  cp "$out/patterns/cdf.png" docs/img/patterns_cdf.png
  "$python" -m bench.docs_update --doc docs/benchmarks.md \
    "patterns=$out/patterns/table.md"
fi

if [[ "$only" == all || "$only" == capacity ]]; then
  echo "== capacity (synthetic engines on the llama-1b H200 schedule; 1/32/64/128 streams)"
  "$python" -m microserving.cli bench capacity --rounds 3 --out "$out/capacity"
  "$python" -m bench.docs_update --doc docs/benchmarks.md \
    "capacity=$out/capacity/table.md:$out/capacity/capacity.json"
fi

if [[ "$only" == all || "$only" == mlc-relay ]]; then
  echo "== mlc relay (direct HTTP vs router + shim --backend mlc on mlc-compat synthetic engines)"
  "$python" -m microserving.cli bench mlc-relay --rounds 3 --duration-s 8 --out "$out/mlc_relay"
  "$python" -m bench.docs_update --doc docs/benchmarks.md \
    "mlc-relay=$out/mlc_relay/table.md:$out/mlc_relay/mlc_relay.json"
fi

if [[ "$only" == all || "$only" == others ]]; then
  # Owned by the engine, shim, router and gateway engineers; their figures go in their docs.
  for script in engine_bench kv_bench router_bench gateway_bench; do
    if [[ -f "bench/$script.py" ]]; then
      echo "== bench/$script.py (see its docs page for the figures)"
      "$python" "bench/$script.py" | tee "$out/$script.txt" || echo "bench/$script.py failed"
    fi
  done
fi
echo "results in $out/"
