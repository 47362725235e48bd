# Prepared 2026-12-05 (ninth session): D's start with P's RemoteSend (5e3cbaf) on the GPU,
# side by side in one call. 1) `scripts/gpu_run.sh` step `ab` over the router's
# MICROSERVING_ROUTER_START_AFTER_KV (false = the calls in turn, then true = the default):
# disagg 1P:1D at 1 and 64 streams, two rounds each; 2) the router inside the gateway's
# process (`bench capacity --embed-router`, `microserving serve`'s topology) at one stream,
# both patterns, for issue 16's one-stream first token (goal: within 3 ms of the engine alone).
# Usage on the device: bash start_after_kv.sh "$OUT"
O=$1; R=/tmp/sak; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== ab $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=ab AB_ENV=MICROSERVING_ROUTER_START_AFTER_KV AB_VALUES="false true" \
  AB_PATTERNS=disagg AB_STREAMS="1 64" AB_ROUNDS=2 AB_TIMEOUT_S=${AB_T:-200} bash scripts/gpu_run.sh > $R/ab.log 2>&1
grep -h -E "^\| disagg" $R/ab_*.log
echo "== embedded router $(date +%T)"
PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 timeout ${EMB_T:-200} \
  python3 -m microserving.cli bench capacity --backend embedded --model llama-1b --device cuda \
  --patterns round-robin disagg --streams 1 --input-len 256 --output-len 256 --requests-per-stream 4 \
  --min-requests 24 --rounds 2 --gateway-workers 1 --embed-router --out $R/embed > $R/embed.log 2>&1
grep -E "^\| (round|disagg)" $R/embed.log
echo "== end $(date +%T)"
