# Run 50's third call (2026-12-07, twenty-second session): where an 8,176-token NIXL send's
# hold goes on the GPU. kv_bench sends 8,176 tokens (30 rows, about 200 warm sends) while
# py-spy records P's shim with its engine core process (--subprocesses) at 1 kHz.
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site
T=$(for i in $(seq 30); do printf "8176 "; done)
timeout 200 python3 -m bench.kv_bench --device cuda --model llama-1b --tokens $T --num-pages 4096 \
  --paths nixl > /tmp/p8k.json 2> /tmp/p8k.log &
for i in $(seq 120); do P=$(pgrep -f "role prefill" | head -1); [ -n "$P" ] && break; sleep 0.5; done
sleep 25  # past the engine's warm-up and the first cold send
echo "P=$P $(date +%T)"; pstree -p $P | head -5
timeout 60 py-spy record --pid $P --subprocesses --rate 1000 --duration 40 --format raw \
  -o $O/p_shim.txt > $O/pyspy.log 2>&1
echo "recorded rc=$? $(date +%T)"
sleep 1; grep -c '"tokens": 8176' /tmp/p8k.log; tail -c 600 /tmp/p8k.log
python3 bench/capacity/profiling.py $O/p_shim.txt --only held_send --top 30 > $O/summary_held.txt 2>&1
python3 bench/capacity/profiling.py $O/p_shim.txt --only spawn_main --top 40 > $O/summary_core.txt 2>&1
python3 bench/capacity/profiling.py $O/p_shim.txt --only remote_send --top 40 > $O/summary_send.txt 2>&1
head -50 $O/summary_core.txt | cut -c1-200
wait
