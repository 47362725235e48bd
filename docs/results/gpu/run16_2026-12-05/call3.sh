# GPU call 3 (2026-12-05, fifth session): the KV benchmark (nixl, shm, gRPC; 1,024 and 8,176
# tokens), then run 15's tree (5aa68d4: before the unbacked shared-memory stage of ba02ade and
# the startup heap freeze of aecf2e9; git worktree add --detach .ab/base 5aa68d4, carry .ab/base)
# against this one, back to back on one host: `scripts/gpu_run.sh` step `ab` (one value),
# disagg and round-robin at 64 and 128 streams, one round each.
# Usage on the device: bash call3.sh "$OUT"
O=$1; R=/tmp/run16c3; rm -rf $R; mkdir -p $R "$O"
pack() { (cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz .); }
echo "== kv $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=kv GPU_KV_TIMEOUT_S=${KV_T:-150} bash scripts/gpu_run.sh > $R/run_kv.log 2>&1
tail -3 $R/kv_bench.log; pack
for tree in base new; do
  dir=$PWD; [ $tree = base ] && dir=$PWD/.ab/base
  echo "== $tree $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site env OUT=$R/$tree GPU_STEPS=ab AB_TIMEOUT_S=${AB_T:-190} \
    AB_ENV=MICROSERVING_AB AB_VALUES=x AB_PATTERNS="disagg round-robin" AB_STREAMS="64 128" \
    AB_ROUNDS=1 bash scripts/gpu_run.sh > $R/ab_$tree.log 2>&1)
  grep -E "^\| (round|disagg)" $R/$tree/ab_x.log; pack
done
echo "== end $(date +%T)"
