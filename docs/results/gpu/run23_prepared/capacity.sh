# Prepared 2026-12-06 (twelfth session). Issue 16's table with the yardstick of each round:
# `scripts/gpu_run.sh` step `capacity` on this tree, three rounds, round-robin and disagg 1P:1D
# at 1/32/64/128 streams, each round's cells against the engine alone run right before them
# (--alone-each-round). Usage on the device: bash capacity.sh "$OUT"
O=$1; R=/tmp/run23_capacity; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== capacity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=capacity GPU_ROUNDS=${CAP_ROUNDS:-3} \
  GPU_REQUESTS_PER_STREAM=${CAP_REQUESTS_PER_STREAM:-4} GPU_CAPACITY_TIMEOUT_S=${CAP_T:-550} \
  bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| (round|disagg)" $R/capacity.log; grep -h "round 0" $R/capacity.log | head -3
grep -c "errors" $R/capacity.log
echo "== end $(date +%T)"
