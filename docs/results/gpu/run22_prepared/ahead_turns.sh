# Prepared 2026-12-06 (eleventh session). P's send with D's PrepRecv (the router's
# MICROSERVING_ROUTER_SEND_AHEAD) off and on at 64 streams, disagg 1P:1D, taking turns: each
# round runs each value on a stack of its own, in the other order each round, and each round's
# cells are measured against the engine alone run right before them (`gpu_run.sh` step `ab`:
# bench capacity --ab-env --alone-each-round). Runs 21 and 22 had the value measured second
# lower by 0.05-0.09 in either order. P logs each send's phases (INFO).
# Usage on the device: bash ahead_turns.sh "$OUT"
O=$1; R=/tmp/run22_turns; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== turns $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=ab AB_ENV=MICROSERVING_ROUTER_SEND_AHEAD AB_VALUES="false true" \
  AB_PATTERNS=disagg AB_STREAMS="${TURNS_STREAMS:-64}" AB_ROUNDS=${TURNS_ROUNDS:-3} \
  AB_REQUESTS_PER_STREAM=${TURNS_REQUESTS_PER_STREAM:-6} AB_TIMEOUT_S=${TURNS_T:-560} \
  AB_ARGS="--shim-arg=--log-level=INFO" bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| disagg" $R/ab.log; grep -c "errors" $R/ab.log
echo "== end $(date +%T)"
