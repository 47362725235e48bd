# GPU call (2026-12-05, sixth session): the NIXL send with D decoding meanwhile, then this tree
# against run 15's. 1) kv_bench, NIXL only, 256 and 1,024 tokens, llama-1b, with 64 greedy
# generations kept running on D (--receiver-load 64): P's log splits each send (hold, claim,
# transfer, confirm); since 3ea3b5c the claim no longer waits for D's step, and since 167b8b5
# an idle core polls its agent every 0.5 ms instead of 1. 2) run 15's ab.sh with .ab/base at
# 5aa68d4 (git worktree add --detach .ab/base 5aa68d4; carry .ab/base): round-robin and disagg
# at 64 and 128 streams, that tree then this one, one round each.
# Usage on the device: bash call.sh "$OUT"
O=$1; R=/tmp/run17; rm -rf $R; mkdir -p $R "$O"
echo "== kv under load $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout ${KV_T:-150} python3 -m bench.kv_bench --model llama-1b --num-pages 4096 \
  --device cuda --tokens 256 1024 --paths nixl --receiver-load 64 \
  > $R/kv_load.json 2> $R/kv_load.log
tail -4 $R/kv_load.log; (cd $R && tar czf "$O/kv.tgz" .)
AB_T=${AB_T:-185} bash docs/results/gpu/run15_2026-12-05/ab.sh "$O/ab"
