# GPU call 1 (2026-12-05, third session): the core loop's busy counter and a py-spy profile of
# every process at 128 streams (round-robin and disagg 1P:1D, one round, with the engine alone
# beside them), the one-stream rows, then the KV-transfer benchmark (nixl, shm, gRPC).
# Usage on the device: bash diag.sh "$OUT"
O=$1; R=/tmp/diag; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== capacity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=capacity GPU_ROUNDS=1 GPU_REQUESTS_PER_STREAM=3 \
  GPU_STREAMS="1 128" GPU_CAPACITY_ARGS="--profile-s 4 --py-spy-arg=--idle" \
  GPU_CAPACITY_TIMEOUT_S=${CAP_T:-300} bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -E "^\| (round|disagg|engine)" $R/capacity.log; grep -iE "idle|busy" $R/capacity.log | head; grep -c "errors" $R/capacity.log
echo "== kv $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=kv GPU_KV_TIMEOUT_S=${KV_T:-200} bash scripts/gpu_run.sh > $R/run_kv.log 2>&1
tail -20 $R/kv_bench.log
echo "== end $(date +%T)"
