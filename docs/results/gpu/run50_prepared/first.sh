# Prepared 2026-12-07 (twenty-first session): the first call of run 50 picks its work by the card
# it lands on: on an H200 (none lent since run 22) issue 16's table, round-robin first
# (table3.sh PART=rr; disagg and kv_ab.sh in the next calls); on an H100 (issue 16's table was
# measured there in runs 47 and 49) the KV A/B of this session's change (kv_ab.sh).
# Usage: bash first.sh "$OUT"
here=$(dirname "$0")
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PART=rr T=${T:-570} bash $here/table3.sh "$1"
else
  bash $here/kv_ab.sh "$1"
fi
