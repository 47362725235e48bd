# Prepared 2026-12-06 (thirteenth session). NIXL writes on one GPU as copies into the
# receiver's pool mapped by CUDA IPC (pool_ipc.py; --kv-nixl-local-copy), NIXL carrying only
# the notification, against NIXL's own transfer: the GPU tests of PD between two shim
# processes (both ways), kv_bench's NIXL path at 1k and 8k tokens (copies, then NIXL's
# transfer), then `scripts/gpu_run.sh` step `ab` over MICROSERVING_SHIM_KV_NIXL_LOCAL_COPY
# (false / true, in the other order each round), disagg at 1 and 64 streams, two rounds.
# Usage on the device: bash ipc.sh "$OUT"
O=$1; R=/tmp/run26_ipc; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
export PYTHONPATH=$PWD:/tmp/site
echo "== tests $(date +%T)"
timeout ${I_TESTS_T:-170} python3 -m pytest -q tests/gpu -k pd_between -p no:cacheprovider > $R/gpu_tests.log 2>&1
tail -4 $R/gpu_tests.log
for lc in true false; do
  echo "== kv local copy $lc $(date +%T)"
  timeout ${I_KV_T:-110} python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 1024 8176 \
    --num-pages 4096 --paths nixl --nixl-local-copy $lc > $R/kv_$lc.json 2> $R/kv_$lc.log
  grep -h '"tokens"' $R/kv_$lc.log | cut -c1-400; tail -2 $R/kv_$lc.log | cut -c1-300
done
echo "== ab $(date +%T)"
OUT=$R GPU_STEPS=ab AB_ENV=MICROSERVING_SHIM_KV_NIXL_LOCAL_COPY AB_VALUES="false true" AB_PATTERNS=disagg \
  AB_STREAMS="1 64" AB_ROUNDS=2 AB_TIMEOUT_S=${I_AB_T:-250} AB_ARGS="--shim-arg=--log-level=INFO" \
  bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| disagg" $R/ab.log; grep -c "errors" $R/ab.log
grep -h "mapped here by CUDA IPC" -r $R/ab 2>/dev/null | head -2
echo "== end $(date +%T)"
