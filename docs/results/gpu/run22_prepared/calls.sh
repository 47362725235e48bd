# Prepared 2026-12-06 (tenth session) for the next loan; none of it has run on a GPU yet.
# Call 1: D's start after the KV waiting in the engine core (the shim's
# MICROSERVING_SHIM_START_AFTER_KV_IN_ENGINE false = in the shim, then true = the default)
# side by side, disagg 1P:1D at 1 and 64 streams, two rounds each; then P's send with D's
# PrepRecv again in the other order than run 21's (MICROSERVING_ROUTER_SEND_AHEAD true, then
# false), 64 streams, three rounds, for its 0.05 drop there. Call 2: run 20's table with rounds
# twice as long.
# Usage on the device: bash calls.sh 1 "$OUT"   then   bash calls.sh 2 "$OUT"
O=$2; R=/tmp/run22_$1; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
case "$1" in
  1) trap finish EXIT
     echo "== in the engine $(date +%T)"
     PYTHONPATH=$PWD:/tmp/site OUT=$R/core GPU_STEPS=ab AB_ENV=MICROSERVING_SHIM_START_AFTER_KV_IN_ENGINE \
       AB_VALUES="false true" AB_PATTERNS=disagg AB_STREAMS="1 64" AB_ROUNDS=2 AB_TIMEOUT_S=200 \
       bash scripts/gpu_run.sh > $R/core.log 2>&1
     for v in false true; do echo "in the engine=$v"; grep -h -E "^\| disagg" $R/core/ab_$v.log; done
     echo "== send ahead, reversed $(date +%T)"
     PYTHONPATH=$PWD:/tmp/site OUT=$R/ahead GPU_STEPS=ab AB_ENV=MICROSERVING_ROUTER_SEND_AHEAD \
       AB_VALUES="true false" AB_PATTERNS=disagg AB_STREAMS="64" AB_ROUNDS=3 AB_TIMEOUT_S=170 \
       bash scripts/gpu_run.sh > $R/ahead.log 2>&1
     for v in true false; do echo "send_ahead=$v"; grep -h -E "^\| disagg" $R/ahead/ab_$v.log; done
     echo "== end $(date +%T)" ;;
  2) CAP_ROUNDS=3 CAP_T=560 CAP_REQUESTS_PER_STREAM=8 bash docs/results/gpu/run15_2026-12-05/full.sh "$O" ;;
esac
