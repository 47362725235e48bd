# Prepared 2026-12-07 (twenty-second session) for the next machine lent, picked by its card.
# An H200 (none lent since run 22): issue 16's table on the current tree, round-robin then
# disagg, three rounds each, each part under its own limit (what finishes is kept).
# An H100: an 8,176-token NIXL send on P's Engine.Generate stream as the router makes it
# (kv_bench --send-via stream) beside the unary call, with send_ms / outside_ms.
# Usage: bash first.sh "$OUT"
O=$1; mkdir -p "$O"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PART=rr T=${T_RR:-280} bash docs/results/gpu/run50_prepared/table3.sh "$O/rr"
  PART=disagg T=${T_DG:-280} bash docs/results/gpu/run50_prepared/table3.sh "$O/disagg"
else
  bash docs/results/gpu/run51_prepared/send_via.sh "$O"
fi
echo "== end $(date +%T)"
