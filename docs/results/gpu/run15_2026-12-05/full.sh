# Prepared for the next device loan (not run: the device was not lent again on 2026-12-05).
# GPU call 2: `scripts/gpu_run.sh` step `capacity` on this tree,
# three rounds (the engine alone and the whole stack, round-robin and disagg 1P:1D, 1/32/64/128
# streams). Usage on the device: bash full.sh "$OUT"
O=$1; R=/tmp/full; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== capacity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=capacity GPU_ROUNDS=${CAP_ROUNDS:-3} GPU_REQUESTS_PER_STREAM=${CAP_REQUESTS_PER_STREAM:-4} \
  GPU_CAPACITY_TIMEOUT_S=${CAP_T:-560} bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -E "^\| (round|disagg)" $R/capacity.log; grep -c "errors" $R/capacity.log
echo "== end $(date +%T)"
