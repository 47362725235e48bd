# GPU call 2 (2026-12-05): the capacity bench at 64 and 128 streams, round-robin and disagg,
# one round, this tree (with py-spy of every process at the largest count, --idle) and the
# tree of 65b86f2 (git worktree add --detach .ab/old 65b86f2; carry .ab/old) on one host.
# Usage on the device: bash ab_tests.sh "$OUT"
O=$1; R=/tmp/abt; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
for tree in new old; do
  dir=$PWD; args=""
  [ $tree = old ] && dir=$PWD/.ab/old
  [ $tree = new ] && args="--profile-s 4 --py-spy-arg=--idle"
  echo "== $tree $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site env OUT=$R/$tree GPU_STEPS=ab AB_TIMEOUT_S=${AB_T:-270} \
    AB_ENV=MICROSERVING_AB AB_VALUES=x AB_PATTERNS="round-robin disagg" AB_STREAMS="64 128" \
    AB_ROUNDS=1 AB_ARGS="$args" bash scripts/gpu_run.sh > $R/ab_$tree.log 2>&1)
  grep -v "^|" $R/$tree/ab_x.log | grep -v "^CPU"; grep -E "^\| (round|disagg)" $R/$tree/ab_x.log
done
echo "== end $(date +%T)"
