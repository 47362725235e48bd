# Prepared 2026-12-07 (twenty-third session), picked by the card lent.
# An H200 (none lent since run 22): issue 16's table on the current tree (run52_prepared).
# An H100: the 8,176-token NIXL send on P's stream and as a unary call, taking turns, three
# turns each (run 53 had one of each: 4.7 against 5.2 ms).
# Usage: bash first.sh "$OUT"
O=$1; mkdir -p "$O"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash docs/results/gpu/run52_prepared/first.sh "$O"; exit
fi
for turn in 1 2 3; do
  bash docs/results/gpu/run51_prepared/send_via.sh "$O/turn$turn" | grep -v "^== end"
done
(cd "$O" && tar czf turns.tgz turn*/ && rm -rf turn*/)
echo "== end $(date +%T)"
