# Prepared 2026-12-08 (twenty-eighth session) after run 73: on one machine, run 60's tree
# (8beb36f) did disagg better than the current tree in both of two turns (0.92 / 0.90 against
# 0.84 / 0.88 at 32 streams, D's PrepRecv half as long, 1-1.5 more busy cores with the
# current tree outside the stack's own CPU), each tree run by its own bench. Now one bench
# (this tree's: the same load, the same engine-alone yardstick right before every cell) runs
# both trees' services, taking turns (MICROSERVING_BENCH_SERVICE_TREE, bench/procs.py), three
# rounds at 32 and 64 streams; each cell names the busy cores outside the stack
# (other_processes, irq_cores), and `top` is sampled every 15 s besides. Either card.
# Carry .gpuwhl .gpunixl .oldtree, made with:
#   mkdir .oldtree && git archive 8beb36f | tar -x -C .oldtree && rm -rf .oldtree/docs
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
(while sleep 15; do date +%T; top -b -H -n 1 -w 200 | head -40; done) > "$O/top.txt" 2>&1 &
topper=$!
timeout ${T:-540} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns disagg --streams 32 64 --rounds ${ROUNDS:-3} \
  --requests-per-stream 6 --min-requests 30 \
  --ab-env MICROSERVING_BENCH_SERVICE_TREE --ab-values "$PWD/.oldtree" "$PWD" \
  --out "$O/bench" > "$O/ab.log" 2>&1
echo "rc=$?"; grep -h -E "round [0-9]+|outside|^\| " "$O/ab.log" | cut -c1-260
kill $topper; gzip -9 "$O/top.txt" "$O"/bench/logs/*.log
echo "== end $(date +%T)"
