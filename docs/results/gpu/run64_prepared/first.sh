# Prepared 2026-12-07 (twenty-fifth session) for the first call of the session, picked by the card.
# An H200 (none lent since run 22): issue 16's table on the current tree, round-robin then
# disagg, as run 60 ran it on an H100 (run50_prepared/table3.sh, the engine alone run cold
# before every cell); PART and ROUNDS choose what one call runs.
# Otherwise: the MLC relay on the host's 16 cores (run63_prepared, no GPU used).
# Usage: source .gpuwhl/prep.sh; PART=rr ROUNDS=2 T=420 bash first.sh "$OUT"
# (as run 64 was called). On an H200 since the bench's lighter engine-alone pass (9a4a514),
# three rounds a call should fit: PART=rr ROUNDS=3 T=560, then PART=disagg ROUNDS=3 T=560.
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt" | grep -q H200; then
  bash docs/results/gpu/run50_prepared/table3.sh "$O/${PART:?}"
elif [ -z "$ONLY_H200" ]; then
  bash docs/results/gpu/run63_prepared/mlc_relay.sh "$O/relay"
else
  echo "not an H200: $(cat "$O/card.txt"); nothing run (ONLY_H200)"
fi
tar -C "$O" -czf "$O/../out.tgz" . 2>/dev/null; mv "$O/../out.tgz" "$O/" 2>/dev/null
echo "== end $(date +%T)"
