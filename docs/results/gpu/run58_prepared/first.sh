# Prepared 2026-12-07 (twenty-third session): issue 16's disagg and round-robin cells at 32 and
# 64 streams, one round each, with the engine alone now starting every run on an empty prefix
# cache (its yardstick run had found its prompts cached: run 57). Each part under its limit.
# On an H200 (none lent since run 22): issue 16's full table instead (run55_prepared).
# Usage: bash first.sh "$OUT"   (ROUNDS=2 T_DG=280 T_RR=250 for two rounds; STREAMS to change the counts)
O=$1; mkdir -p "$O"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/results/gpu/run55_prepared/first.sh "$O"; exit
fi
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/card.txt
for part in "disagg ${T_DG:-130}" "round-robin ${T_RR:-110}"; do
  set -- $part; R=/tmp/r58-$1; rm -rf $R
  echo "== $1 $(date +%T)"
  timeout $2 python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
    --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
    --router-replicas 2 --patterns $1 --streams ${STREAMS:-32 64} --rounds ${ROUNDS:-1} --requests-per-stream 6 \
    --min-requests 30 --out $R > $O/$1.log 2>&1
  echo "rc=$? $(date +%T)"; grep -h -E "alone|^  $1|shim-" $O/$1.log | cut -c1-220
  cp $R/cells.jsonl $O/cells-$1.jsonl 2>/dev/null; cp $R/capacity.json $O/capacity-$1.json 2>/dev/null
done
echo "== end $(date +%T)"
