# Prepared 2026-12-07 (twenty-sixth session) for the session's one call (about 1,000 s of
# device time left after three refused starts and one machine taken back mid-call).
# An H200: issue 16's disagg rows on the current tree, three rounds (run50_prepared/table3.sh,
# PART=disagg: the H200's weakest rows in runs 20-22, 0.89 / 0.83 / 0.78).
# Otherwise (an H100, where the table was taken in runs 58-61): the first token at one stream
# with the router in the gateway's process (`microserving serve`, bench --embed-router)
# against the split stack, taking turns, both patterns, the engine alone right before each
# cell. Disagg's first token sits at the 3 ms goal's edge on the split stack (+3.10 ms, run 65).
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
if nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt" | grep -q H200; then
  PART=disagg ROUNDS=3 T=${T:-540} bash docs/results/gpu/run50_prepared/table3.sh "$O/disagg"
else
  for turn in split1 serve1 split2 serve2; do
    extra=""; case $turn in serve*) extra="--embed-router";; esac
    echo "== $turn $(date +%T)"
    timeout ${TURN_T:-130} python3 -m microserving.cli bench capacity --backend embedded \
      --model llama-1b --device cuda --input-len 256 --output-len 256 --alone-each-round \
      --gateway-workers 4 --patterns round-robin disagg --streams 1 --rounds 1 \
      --requests-per-stream 16 $extra --out /tmp/r68-$turn > "$O/$turn.log" 2>&1
    echo "rc=$?"; grep -h -E "round [0-9]+:" "$O/$turn.log" | cut -c1-200
    cp /tmp/r68-$turn/capacity.json "$O/$turn.json" 2>/dev/null
  done
fi
tar -C "$O" -czf "/tmp/out68.tgz" . 2>/dev/null; mv /tmp/out68.tgz "$O/"
echo "== end $(date +%T)"
