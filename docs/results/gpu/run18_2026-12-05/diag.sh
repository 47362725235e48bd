# GPU call (2026-12-05, seventh session): call 1 (full.sh of run 15, three rounds) stalled in
# disagg's third round at 128 streams (0.33 of the engine alone; 19 of 512 RemoteSends failed
# after the 10 s write deadline, the requests retried), without MPS. Disagg at 128 streams,
# eight rounds, every router and shim at INFO, to find which side's wait ran out.
# Usage on the device: bash diag.sh "$OUT"
O=$1; R=/tmp/diag18; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -size +8M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== diag $(date +%T)"
# Once D's core logs a write with no notification after 1 s (a stall), dump where P's and D's
# core processes and shims are (py-spy dump, Python and native frames), twice, 2 s apart.
watch_stall() {
  while sleep 0.5; do
    grep -q "no notification of the KV write" $R/cap/logs/disagg-shim-decode.log 2>/dev/null || continue
    for n in 1 2; do
      for role in prefill decode; do
        core=$(grep -o "engine thread native id [0-9]*" $R/cap/logs/disagg-shim-$role.log | tail -1 | awk '{print $5}')
        shim=$(ps -o ppid= -p "$core" | tr -d " ")
        { echo "== $role core $core $(date +%T.%N)"; py-spy dump --pid $core --native 2>&1 | head -80
          [ -n "$shim" ] && { echo "== $role shim $shim"; py-spy dump --pid $shim 2>&1 | head -60; }
        } >> $R/stall_dump.txt
      done
      nvidia-smi >> $R/stall_dump.txt 2>&1; sleep 2
    done
    return
  done
}
watch_stall & WATCH=$!
PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 timeout ${T:-300} \
  python3 -m microserving.cli bench capacity --backend embedded --model llama-1b --device cuda \
  --patterns disagg --streams 128 --input-len 256 --output-len 256 --requests-per-stream 4 \
  --min-requests 24 --rounds ${ROUNDS:-8} --gateway-workers 4 --router-replicas 2 \
  --shim-arg=--log-level=INFO --router-arg=--log-level=INFO --out $R/cap > $R/cap.log 2>&1
grep -E "round [0-9]:" $R/cap.log | grep disagg
cat $R/cap/logs/*router*.log | grep -E "retrying|resuming" | sed -E 's/.*after //' | sort | uniq -c | head -8
for side in prefill decode; do grep -h -iE "warn|error|did not|fail" $R/cap/logs/*shim-$side.log | cut -c1-400 | head -12; done
kill $WATCH 2>/dev/null; [ -f $R/stall_dump.txt ] && grep -A25 "== prefill core" $R/stall_dump.txt | head -60
echo "== end $(date +%T)"
