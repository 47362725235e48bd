# Prepared 2026-12-06 (twelfth session). The NIXL core's spin window, one a write (the tree
# before 12c975e, carried as .ab/b23) against one a loop turn (this tree), side by side on one
# host: `scripts/gpu_run.sh` step `capacity`, disagg at 64 and 128 streams, one round per run,
# each tree run twice in the order base, new, new, base, every run against the engine alone
# run right before its cells; P logs each send's phases (INFO).
# Usage on the device (carry .ab/b23): bash spin_ab.sh "$OUT"
O=$1; R=/tmp/run23_spin; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +4M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
here=$PWD
i=0
for tree in base new new base; do
  i=$((i + 1)); dir=$here; [ $tree = base ] && dir=$here/.ab/b23
  echo "== $i $tree $(date +%T)"
  (cd $dir && PYTHONPATH=/tmp/site OUT=$R/${i}_$tree GPU_STEPS=capacity GPU_STREAMS="${S_STREAMS:-64 128}" GPU_ROUNDS=1 \
    GPU_REQUESTS_PER_STREAM=${S_REQUESTS_PER_STREAM:-6} GPU_CAPACITY_TIMEOUT_S=${S_T:-150} \
    GPU_CAPACITY_ARGS="--patterns disagg --shim-arg=--log-level=INFO" bash scripts/gpu_run.sh > $R/${i}_$tree.log 2>&1)
  grep -h -E "^\| disagg" $R/${i}_$tree/capacity.log; grep -h "yardstick" $R/${i}_$tree/capacity.log
done
echo "== end $(date +%T)"
