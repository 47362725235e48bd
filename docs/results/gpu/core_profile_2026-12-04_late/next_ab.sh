# The side by side this session could not run (no device lent after run 13): the capacity
# bench, round-robin and disagg at 64 and 128 streams, one round, for this tree and for the
# session's start, 65b86f2 (git worktree add --detach .ab/old 65b86f2; carry .ab/old), on
# one host. About 400-500 s on an H200. Usage on the device: bash next_ab.sh "$OUT"
O=$1; R=/tmp/next_ab; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
for tree in new old; do
  dir=$PWD
  [ $tree = old ] && dir=$PWD/.ab/old
  echo "== $tree $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site env OUT=$R/$tree GPU_STEPS=ab AB_TIMEOUT_S=270 \
    AB_ENV=MICROSERVING_AB AB_VALUES=x AB_PATTERNS="round-robin disagg" AB_STREAMS="64 128" \
    AB_ROUNDS=1 bash scripts/gpu_run.sh > $R/ab_$tree.log 2>&1)
  grep -v "^|" $R/$tree/ab_x.log | grep -v "^CPU"; grep -E "^\| (round|disagg)" $R/$tree/ab_x.log
done
echo "== end $(date +%T)"
