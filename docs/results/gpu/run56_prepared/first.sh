# Prepared 2026-12-07 (twenty-third session). An H200: issue 16's table (run55_prepared).
# An H100: disagg at 32 streams with the shims at INFO, so P logs each RemoteSend's phases
# (where the router's 40 ms RemoteSend mean of run 53 goes), once as a closed loop and once
# with the stack's streams started 1.5 ms apart (--stagger-ms, as the staggered yardstick).
# Usage: bash first.sh "$OUT"
O=$1; mkdir -p "$O"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/results/gpu/run55_prepared/first.sh "$O"; exit
fi
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
for stagger in 0 1.5; do
  R=/tmp/r56-$stagger; rm -rf $R
  echo "== disagg 32 stagger $stagger $(date +%T)"
  timeout ${T_C:-200} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
    --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
    --router-replicas 2 --patterns disagg --streams 32 --rounds 1 --requests-per-stream 6 \
    --min-requests 30 --stagger-ms $stagger --shim-arg=--log-level=INFO --out $R > $O/cell-$stagger.log 2>&1
  echo "rc=$? $(date +%T)"; grep -h -E "^\| disagg|round [0-9]|shim-" $O/cell-$stagger.log | cut -c1-300
  python3 docs/results/gpu/run56_prepared/phases.py $R/logs/disagg-shim-prefill.log
  python3 -c "
import json
for l in open('$R/cells.jsonl'):
    d = json.loads(l); print({k: d.get(k) for k in ('engine_calls', 'router_ttft', 'second_token_p50_ms', 'second_token_p99_ms', 'ttft_p50_ms', 'itl_p50_ms')})"
  cp $R/cells.jsonl $O/cells-$stagger.jsonl
  (cd $R/logs && grep -h "RemoteSend" disagg-shim-prefill.log > $O/p-sends-$stagger.log)
  (cd $R/logs && grep -v "RemoteSend" disagg-shim-prefill.log | tail -50 > $O/p-tail-$stagger.log; tail -80 disagg-shim-decode.log > $O/d-tail-$stagger.log)
done
echo "== end $(date +%T)"
