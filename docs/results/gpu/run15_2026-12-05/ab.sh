# Prepared for the next device loan (not run: the device was not lent again on 2026-12-05).
# GPU call 3: the capacity bench at 64 and 128 streams, round-robin
# and disagg, one round, the tree of ba02ade (before the startup heap freeze; git worktree add
# --detach .ab/base ba02ade; carry .ab/base) and this tree, alternating, on one host.
# Usage on the device: bash ab.sh "$OUT"
O=$1; R=/tmp/ab; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
for tree in base new; do
  dir=$PWD; [ $tree = base ] && dir=$PWD/.ab/base
  echo "== $tree $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site env OUT=$R/$tree GPU_STEPS=ab AB_TIMEOUT_S=${AB_T:-270} \
    AB_ENV=MICROSERVING_AB AB_VALUES=x AB_PATTERNS="round-robin disagg" AB_STREAMS="64 128" \
    AB_ROUNDS=1 bash scripts/gpu_run.sh > $R/ab_$tree.log 2>&1)
  grep -E "^\| (round|disagg)" $R/$tree/ab_x.log
done
echo "== end $(date +%T)"
