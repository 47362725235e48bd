# GPU call 3 (2026-12-05, fifth session): the KV benchmark (nixl, shm, gRPC; 1,024 and 8,176
# tokens), then run 15's ab.sh with .ab/base at run 15's tree (5aa68d4: before the unbacked
# shared-memory stage of ba02ade and the startup heap freeze of aecf2e9; git worktree add
# --detach .ab/base 5aa68d4, carry .ab/base): that tree against this one, back to back on one
# host, round-robin and disagg at 64 and 128 streams, one round each.
# Usage on the device: bash call3.sh "$OUT"
O=$1; R=/tmp/run16c3; rm -rf $R; mkdir -p $R "$O"
echo "== kv $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=kv GPU_KV_TIMEOUT_S=${KV_T:-150} bash scripts/gpu_run.sh > $R/run_kv.log 2>&1
tail -3 $R/kv_bench.log; (cd $R && tar czf "$O/kv.tgz" .)
AB_T=${AB_T:-190} bash docs/results/gpu/run15_2026-12-05/ab.sh "$O/ab"
