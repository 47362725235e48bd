# Run 61 as it ran (2026-12-07, twenty-fourth session, the same H100 right after run 60): one
# round of each pattern at one stream, the shims at INFO so that P logs each send's phases
# (read with run56_prepared/phases.py; the logs are in logs.tgz).
source .gpuwhl/prep.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
timeout 150 python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
  --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
  --router-replicas 2 --patterns disagg round-robin --streams 1 --rounds 1 \
  --requests-per-stream 6 --min-requests 30 --shim-arg=--log-level=INFO --out /tmp/r61 > "$OUT/one.log" 2>&1
python3 docs/results/gpu/run56_prepared/phases.py /tmp/r61/logs/disagg-shim-prefill.log
