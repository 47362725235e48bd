# Prepared 2026-12-06 (thirteenth session). kv_bench's NIXL path at 1k and 8k tokens with the
# copies into D's mapped pool in 8-byte words (pool_ipc.slot_view; run 26 copied bytes; NIXL's
# own transfer is run 26's, for want of device time); then one stream's first token for round-robin and disagg, the split
# stack and then the router in the gateway's process (--embed-router, one router a worker).
# Usage on the device: bash final.sh "$OUT"
O=$1; R=/tmp/run27_final; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
export PYTHONPATH=$PWD:/tmp/site
for lc in true; do
  echo "== kv local copy $lc $(date +%T)"
  timeout ${F_KV_T:-90} python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 1024 8176 \
    --num-pages 4096 --paths nixl --nixl-local-copy $lc > $R/kv_$lc.json 2> $R/kv_$lc.log
  grep -h '"tokens"' $R/kv_$lc.log | cut -c1-300
done
for mode in split embed; do
  echo "== one stream, $mode $(date +%T)"
  extra=""; replicas=2; [ $mode = embed ] && extra="--embed-router" && replicas=1
  GPU_ROUTER_REPLICAS=$replicas OUT=$R/$mode GPU_STEPS=capacity GPU_STREAMS=1 GPU_ROUNDS=1 \
    GPU_REQUESTS_PER_STREAM=24 GPU_MIN_REQUESTS=24 GPU_CAPACITY_TIMEOUT_S=${F_T:-160} \
    GPU_CAPACITY_ARGS="--patterns round-robin disagg $extra" bash scripts/gpu_run.sh > $R/run_$mode.log 2>&1
  grep -h -E "^\| (round|disagg)" $R/$mode/capacity.log | cut -c1-200
done
python3 - "$R" <<'PY'
import json, sys
for lc in ("true",):
    try:
        rows = json.load(open(f"{sys.argv[1]}/kv_{lc}.json"))["rows"]
    except Exception as error:
        print(lc, "no kv rows:", error); continue
    for r in rows:
        print("kv", lc, r["tokens"], r["nixl_transfer_s"], r["nixl_gbps"], r.get("nixl_phases"))
PY
echo "== end $(date +%T)"
