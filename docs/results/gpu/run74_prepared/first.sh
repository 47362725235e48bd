# Prepared 2026-12-08 (twenty-eighth session) after run 73: on one machine, run 60's tree
# (8beb36f, carried as .oldtree: `git archive 8beb36f | tar -x -C .oldtree`, docs/results
# trimmed) did disagg better than the current tree in both of two turns (0.92 / 0.90 against
# 0.84 / 0.88 at 32 streams, D's PrepRecv half as long, 1-1.5 more busy cores with the
# current tree outside the stack's own CPU). More turns, at 32 streams only, with a `top`
# snapshot every 15 s (which processes and threads take the extra cores; the current tree's
# bench also names them per cell: other_processes, irq_cores). Either card.
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"   (carry .gpuwhl .gpunixl .oldtree)
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1 MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
(while sleep 15; do date +%T; top -b -H -n 1 -w 200 | head -40; done) > "$O/top.txt" 2>&1 &
topper=$!
for turn in old1 new1 old2 new2 old3 new3; do
  dir=$PWD; [ "${turn#old}" != "$turn" ] && dir=$PWD/.oldtree
  echo "== $turn $(date +%T)" | tee -a "$O/top.txt"
  (cd "$dir" && STREAMS="32" ROUNDS=1 PART=disagg T=${T:-90} \
     bash docs/results/gpu/run50_prepared/table3.sh "/tmp/r74/$turn" | grep -E "^\| disagg|rc=")
  cp /tmp/r74/$turn/cells.jsonl "$O/$turn.cells.jsonl" 2>/dev/null
done
kill $topper
gzip -9 "$O/top.txt"
echo "== end $(date +%T)"
