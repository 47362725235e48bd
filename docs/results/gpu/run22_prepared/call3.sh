# Prepared 2026-12-06 (eleventh session); not run (a refused start left too little device
# time for another). The
# capacity step on this tree, one round, disagg 1P:1D at 64 and 128 streams (round-robin
# was call 2's), each stream count's cells against the engine alone run right before them.
# Usage on the device: bash call3.sh "$OUT"
O=$1; R=/tmp/run22_call3; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== capacity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=capacity GPU_STREAMS="64 128" GPU_ROUNDS=1 \
  GPU_REQUESTS_PER_STREAM=6 GPU_CAPACITY_TIMEOUT_S=${C3_T:-170} GPU_CAPACITY_ARGS="--patterns disagg" \
  bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| (round|disagg)" $R/capacity.log; grep -h "round 0" $R/capacity.log
echo "== end $(date +%T)"
