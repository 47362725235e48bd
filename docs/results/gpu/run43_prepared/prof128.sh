# Prepared 2026-12-06 (seventeenth session). Run 42 (wide.sh) measured 128 streams in one
# round: disagg 0.56 of the engine alone's yardstick (0.79 of its staggered run), round-robin
# 0.74 (1.02); the decoding shim's core took 2.81 ms a step and 3.37 ms a loop turn at 114
# tokens a step, where the engine alone took 2.48 / 2.58 at 120. Where do D's extra 0.3 ms
# in a step and 0.5 ms a turn go? Both patterns at 128 streams, ten requests a stream (the
# embedded backend counts tokens from usage: no timed window), every process under py-spy for
# the cell's first 12 s (its core process included: --subprocesses), the engine alone before
# each stack. (Run 43 gave --duration-s, which the embedded backend refuses.) Profiles and logs
# land in $OUT/r43 as the bench writes them. Usage: bash prof128.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== profile 128 $(date +%T)"
timeout ${P_T:-360} python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --gateway-workers 4 --router-replicas 2 \
  --patterns disagg round-robin --streams 128 --rounds 1 --requests-per-stream 10 --min-requests 64 \
  --profile-s 12 --out $O/r43 > $O/prof.log 2>&1
rc=$?; echo "rc=$rc $(date +%T)"; [ $rc = 0 ] || { tail -5 $O/prof.log; exit 1; }
grep -h -E "^\| |round [0-9]|engine alone" $O/prof.log | cut -c1-300
for f in $O/r43/profile-*shim*.txt; do
  echo "== core of $f"; python3 -m bench.capacity.profiling $f --top 30 --only spawn_main 2>&1 | head -70
done
echo "== end $(date +%T)"
