# Prepared 2026-12-06 (tenth session): P's RemoteSend made with D's PrepRecv (send_ahead) on
# the GPU, side by side in one call. 1) `scripts/gpu_run.sh` step `ab` over the router's
# MICROSERVING_ROUTER_SEND_AHEAD (false = RemoteSend after PrepRecv, then true = the default):
# disagg 1P:1D at 1 and 64 streams, two rounds each; 2) round-robin and disagg at one stream
# in one run, for issue 21's goal (disagg's first token within 2 ms of round-robin's).
# Usage on the device: bash send_ahead.sh "$OUT"
O=$1; R=/tmp/sah; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== ab $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=ab AB_ENV=MICROSERVING_ROUTER_SEND_AHEAD AB_VALUES="false true" \
  AB_PATTERNS=disagg AB_STREAMS="1 64" AB_ROUNDS=2 AB_TIMEOUT_S=${AB_T:-200} bash scripts/gpu_run.sh > $R/ab.log 2>&1
grep -h -E "^\| disagg" $R/ab_*.log
echo "== one stream $(date +%T)"
PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 timeout ${ONE_T:-150} \
  python3 -m microserving.cli bench capacity --backend embedded --model llama-1b --device cuda \
  --patterns round-robin disagg --streams 1 --input-len 256 --output-len 256 --requests-per-stream 4 \
  --min-requests 24 --rounds 2 --gateway-workers 4 --router-replicas 2 --out $R/one > $R/one.log 2>&1
grep -E "^\| (round|disagg)" $R/one.log
echo "== end $(date +%T)"
