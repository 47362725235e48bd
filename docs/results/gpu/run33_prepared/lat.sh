# Prepared 2026-12-06 (fifteenth session). One stream on this tree (gRPC's iomgr stack, the
# default since cbbe4ed) with the CPU latency bound of 0 (idle pollers on this host: no
# cpuidle driver), then where disagg's first token goes now.
# 1. `bench capacity` at one stream, two rounds, the engine alone before each round's cells:
#    the split stack (round-robin and disagg), then round-robin with the router in the gateway.
# 2. The same tree with temporary timestamps at every hop and now also the KV handshake's
#    (stamps.patch here, ../run25_prepared/_stamp.py: CLOCK_MONOTONIC, one file per process;
#    not committed to the code), one round, split stack, round-robin and disagg, and run 25's
#    an2.py's per-request timeline.
# The stamped tree is expected at $S (a copy of this tree with stamps.patch applied).
# Logs go straight to $OUT (a call cut short still returns them). Usage: bash lat.sh "$OUT" S
O=$1; S=$2; mkdir -p "$O"; H=$(cd "$(dirname "$0")/../run25_prepared" && pwd)
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 MICROSERVING_GATEWAY_CPU_LATENCY_US=0
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --requests-per-stream 30 --min-requests 30 --alone-each-round --streams 1 --gateway-workers 4"
echo "== split $(date +%T)"
timeout ${L_SPLIT_T:-200} python3 -m microserving.cli bench capacity $common --rounds 2 \
  --patterns round-robin disagg --router-replicas 2 --out /tmp/r33s > $O/split.log 2>&1
grep -h -E "^\| (round|disagg)|yardstick" $O/split.log
echo "== embed $(date +%T)"
timeout ${L_EMBED_T:-110} python3 -m microserving.cli bench capacity $common --rounds 2 \
  --patterns round-robin --embed-router --out /tmp/r33e > $O/embed.log 2>&1
grep -h -E "^\| round|yardstick" $O/embed.log
echo "== stamped $(date +%T)"
(cd "$S" && PYTHONPATH=$S:/tmp/site MSSTAMP_DIR=/tmp/r33st timeout ${L_STAMP_T:-150} python3 -m microserving.cli \
  bench capacity $common --rounds 1 --patterns round-robin disagg --router-replicas 2 \
  --out /tmp/r33t > $O/stamped.log 2>&1)
grep -h -E "^\| (round|disagg)" $O/stamped.log
for p in shim-both shim-decode; do
  python3 $H/an2.py /tmp/r33st $p > $O/timeline_$p.txt 2>&1; head -1 $O/timeline_$p.txt
done
tail -30 $O/timeline_shim-decode.txt
echo "== end $(date +%T)"
