# GPU call (2026-12-05, sixth session): run 17's call saw disagg at 128 streams on this tree at
# 0.25 of the engine alone (38 PrepRecvs answered only after the router's 10 s deadline, the
# request then retried; base tree 0.78); 720ffc1 then fixed a race that the shim-owned TTL
# made frequent (a notification read by D's core before the claim's expect was passed on as
# complete). Disagg at 128 streams, one round, every router and
# shim at INFO (the router logs each retry and its cause): this tree, 167b8b5 (before the
# shim-owned TTL; git worktree add --detach .ab/sel 167b8b5, with this tree's
# bench/capacity/cli.py for --router-arg; carry .ab/sel), this tree again.
# Usage on the device: bash diag.sh "$OUT"
O=$1; R=/tmp/diag17; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -size +3M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
for run in new-1 sel new-2; do
  dir=$PWD; [ $run = sel ] && dir=$PWD/.ab/sel
  echo "== $run $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 timeout ${T:-150} \
    python3 -m microserving.cli bench capacity --backend embedded --model llama-1b --device cuda \
    --patterns disagg --streams 128 --input-len 256 --output-len 256 --requests-per-stream 4 \
    --min-requests 24 --rounds 1 --gateway-workers 4 --router-replicas 2 \
    --shim-arg=--log-level=INFO --router-arg=--log-level=INFO --out $R/$run > $R/$run.log 2>&1)
  grep -E "^\| disagg" $R/$run.log
  cat $R/$run/logs/*router*.log | grep -E "retrying|resuming" | sed -E 's/.*after //' | sort | uniq -c | head -5
  grep -h -iE "warn|error" $R/$run/logs/*shim*.log | head -3
done
echo "== end $(date +%T)"
