# Prepared 2026-12-06 (fifteenth session). gRPC's I/O stack side by side on the GPU: since
# cbbe4ed every service runs on gRPC's iomgr stack (microserving/grpc_io.py), measured only on
# the VM. GRPC_EXPERIMENTS over EventEngine (gRPC's own default) and iomgr, each value on a
# stack started with it, taking turns (bench capacity --ab-env), the engine alone before each
# round's cells; split stack, round-robin and disagg at 1, 64 and 128 streams, one round.
# Logs go straight to $OUT (a call cut short still returns them). Usage: bash io_ab.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nproc > $O/machine.txt; nvidia-smi -L >> $O/machine.txt 2>&1
ee=event_engine_dns,event_engine_client,event_engine_listener
io=event_engine_dns,-event_engine_client,-event_engine_listener
echo "== start $(date +%T)"
timeout ${IO_T:-510} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --requests-per-stream 4 --min-requests 30 \
  --rounds ${IO_ROUNDS:-1} --alone-each-round --streams ${IO_STREAMS:-1 64 128} \
  --patterns ${IO_PATTERNS:-round-robin disagg} --ab-env GRPC_EXPERIMENTS --ab-values $ee $io \
  --gateway-workers 4 --router-replicas 2 --out $O/ab > $O/ab.log 2>&1
echo "rc=$? $(date +%T)"
grep -h -E "^\| |yardstick|round 0:" $O/ab.log | tail -40
