# Prepared 2026-12-05 (eighth session; no device time left to run it). The next loan's first
# call, on a tree at or after 7140ebf: none of c396bd8 (the core pipe's writer), ee3f48d (NIXL
# peers dropped after their writes) or 7140ebf (a parked claim given up before its deadline, no
# HoldKV per send) has run on a GPU. 1) kv_bench over NIXL, 256 / 1,024 / 8,192 tokens, D idle,
# then with 64 greedy generations kept running on D (issue 21: 8k GB/s, a RemoteSend under
# load); 2) disagg at 128 streams, four rounds, every router and shim at INFO (run 18's
# diag.sh: does the stall come back?). Then call 2 (run 15's full.sh, three rounds).
# Usage on the device: bash call1.sh "$OUT"
O=$1; R=/tmp/run19; rm -rf $R; mkdir -p $R "$O"
echo "== kv idle $(date +%T)"
PYTHONPATH=$PWD:/tmp/site timeout ${KV_T:-120} python3 -m bench.kv_bench --model llama-1b --num-pages 8192 \
  --device cuda --tokens 256 1024 8192 --paths nixl shm > $R/kv_idle.json 2> $R/kv_idle.log
tail -3 $R/kv_idle.log
# the load as a router puts it on D (one Engine.Generate stream), then as runs 15-17 did (a
# StartGenerate call per generation, a message per token each)
for via in stream start-generate; do
  echo "== kv under load via $via $(date +%T)"
  PYTHONPATH=$PWD:/tmp/site timeout ${KV_T:-100} python3 -m bench.kv_bench --model llama-1b --num-pages 8192 \
    --device cuda --tokens 256 1024 --paths nixl --receiver-load 64 --receiver-load-via $via \
    > $R/kv_load_$via.json 2> $R/kv_load_$via.log
  tail -2 $R/kv_load_$via.log
done
(cd $R && tar czf "$O/kv.tgz" .)
ROUNDS=${ROUNDS:-4} T=${DIAG_T:-200} bash docs/results/gpu/run18_2026-12-05/diag.sh "$O/diag"
