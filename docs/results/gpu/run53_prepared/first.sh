# Prepared 2026-12-07 (twenty-third session), picked by the card lent.
# An H200 (none lent since run 22): issue 16's table on the current tree (run52_prepared).
# An H100: the 8,176-token NIXL send on P's stream beside the unary call (send_via.sh), then
# disagg at 32 streams, one round, with py-spy (--idle) of every process, D's core included,
# to see what D's core does outside its step (0.15-0.25 ms a loop turn in runs 49-51).
# Usage: bash first.sh "$OUT"
O=$1; mkdir -p "$O"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/results/gpu/run52_prepared/first.sh "$O"; exit
fi
bash docs/results/gpu/run51_prepared/send_via.sh "$O/send"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
R=/tmp/r53; rm -rf $R
echo "== disagg 32 profiled $(date +%T)"
timeout ${T_P:-200} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns disagg --streams 32 --rounds 1 --requests-per-stream 6 \
  --min-requests 30 --profile-s 8 --py-spy-arg=--idle --out $R > $O/profiled.log 2>&1
echo "rc=$? $(date +%T)"; grep -h -E "^\| |round [0-9]" $O/profiled.log | cut -c1-300
for f in $R/profile-*.txt; do
  [ -f "$f" ] || continue
  case $f in *shim*) python3 bench/capacity/profiling.py "$f" --only spawn_main --top 30;; esac
done > $O/core_summary.txt 2>&1
head -150 $O/core_summary.txt
(cd $R && tar czf $O/profiles.tgz profile-*.txt cells.jsonl capacity.json 2>/dev/null)
echo "== end $(date +%T)"
