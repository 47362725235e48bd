# Prepared 2026-12-06 (twelfth session). Where disagg's first token goes under load: run 23's
# capacity call had D's batch at 56.5 of 64 sequences a step (the engine alone 61.9) with the
# router's RemoteSend at 56 ms mean (p50 37) while P idled 62% of its loop. `bench capacity`
# disagg at 1 and 64 streams, one round, every shim logging at INFO (P each send's phases),
# py-spy on every process of the 64-stream cell (the cores included); then kv_bench.
# Usage on the device: bash diag.sh "$OUT"
O=$1; R=/tmp/run23_diag; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +4M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== capacity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=capacity GPU_STREAMS="1 64" GPU_ROUNDS=1 \
  GPU_REQUESTS_PER_STREAM=${D_REQUESTS_PER_STREAM:-8} GPU_CAPACITY_TIMEOUT_S=${D_T:-200} \
  GPU_CAPACITY_ARGS="--patterns disagg --shim-arg=--log-level=INFO --profile-s 3" \
  bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| disagg" $R/capacity.log; grep -c "errors" $R/capacity.log
echo "== kv $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=kv GPU_KV_TIMEOUT_S=${D_KV_T:-200} bash scripts/gpu_run.sh >> $R/run.log 2>&1
tail -5 $R/kv_bench.log
echo "== end $(date +%T)"
