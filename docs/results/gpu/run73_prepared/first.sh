# Prepared 2026-12-08 (twenty-eighth session) after run 72 (an H100, disagg 0.87 / 0.87 / 0.90
# at 32 / 64 / 128 streams, first token +6.9 ms at one stream, where run 60 had 0.92 / 0.94 /
# 0.96 and +3.4 on another H100 host): the host or the tree? Run 60's tree (8beb36f, carried
# as .oldtree: git archive 8beb36f) and main take turns on one machine, disagg at 1, 32 and
# 64 streams, one round a turn, the engine alone right before every cell.
# Usage: source .gpuwhl/prep.sh; bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1 MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
for turn in new1 old1 new2 old2; do
  dir=$PWD; [ "${turn#old}" != "$turn" ] && dir=$PWD/.oldtree
  echo "== $turn"
  (cd "$dir" && STREAMS="1 32 64" ROUNDS=1 PART=disagg T=${T:-140} \
     bash docs/results/gpu/run50_prepared/table3.sh "$O/$turn" | grep -E "^\| disagg|rc=")
done
echo "== end $(date +%T)"
