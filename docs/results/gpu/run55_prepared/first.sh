# Prepared 2026-12-07 (twenty-third session): issue 16's table on an H200 (none lent since
# run 22), round-robin then disagg, three rounds each (run52_prepared -> run50_prepared/table3.sh).
# On an H100 it only says so and ends: what an H100 can measure of the current tree is in runs
# 49-54, so a call that gets one costs only the machine's start.
# Usage: bash first.sh "$OUT"
O=$1; mkdir -p "$O"
if nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt" | grep -q H200; then
  bash docs/results/gpu/run52_prepared/first.sh "$O"; exit
fi
echo "not an H200: $(cat "$O/card.txt")"
