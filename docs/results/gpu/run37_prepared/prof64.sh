# Prepared 2026-12-06 (fifteenth session) for the next loan. Run 34 found the in-process engine
# alone ~20% faster at 64 streams with the CPU latency bound's idle pollers up (38.4-39.1k tok/s
# against 32.1k), while the stack's engine core process kept its 1.77-1.79 ms a step: why?
# 1. The whole `bench capacity` run under one `py-spy record --subprocesses` (raw): the engine
#    alone runs in the bench process (its loop thread: _ThreadDriver, then CoreLoop, as in a shim
#    without a core process), the stack's processes are its children (the shim's core: spawn_main). Round-robin, 64
#    streams, one round, the engine alone right before the cell, the pollers up. Summaries of the
#    bench process's engine loop and of the core process follow (bench.capacity.profiling).
# 2. Round-robin at one stream on the defaults, three rounds (run 36 ran out of time before its
#    table; since 9bd50c0 each cell's first token is on its stderr line and in cells.jsonl).
# Logs go straight to $OUT. Usage: bash prof64.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --alone-each-round --gateway-workers 4 --router-replicas 2 --patterns round-robin --rounds 1"
echo "== profile $(date +%T)"
MICROSERVING_GATEWAY_CPU_LATENCY_US=0 timeout ${P_T:-240} py-spy record --subprocesses --rate 200 \
  --format raw --nonblocking -o $O/all.txt -- python3 -m microserving.cli bench capacity $common \
  --streams 64 --requests-per-stream 8 --min-requests 64 --out /tmp/r37p > $O/prof.log 2>&1
echo "rc=$? $(date +%T)"
grep -h -E "engine alone|streams   64 round|shim-both" $O/prof.log | cut -c1-220
python3 -m bench.capacity.profiling $O/all.txt --top 30 --only _ThreadDriver > $O/alone_top.txt 2>&1
python3 -m bench.capacity.profiling $O/all.txt --top 30 --only spawn_main > $O/core_top.txt 2>&1
head -40 $O/alone_top.txt; head -40 $O/core_top.txt
echo "== one stream, defaults $(date +%T)"
timeout ${D_T:-240} python3 -m microserving.cli bench capacity $common --rounds 3 --streams 1 \
  --requests-per-stream 30 --min-requests 30 --out /tmp/r37d > $O/one.log 2>&1
echo "rc=$?"; cp /tmp/r37d/cells.jsonl /tmp/r37d/capacity.json $O/ 2>/dev/null
grep -h -E "^\| |round [0-9]:" $O/one.log | cut -c1-220
echo "== end $(date +%T)"
