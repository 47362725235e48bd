# Prepared 2026-12-07 (twenty-fourth session): issue 16's MLC item (`shim --backend mlc` + the
# router relaying >= 0.9 of what a direct HTTP client of the same engines gets at 32 and 128
# streams, <= one raw round trip added to the first token at one stream) on a host with a core
# per process. On the 2-core VM every process of both sides shares two cores, so the relay's
# extra processes cost tokens/s there whatever they do (0.84 / 0.67 round-robin, 0.68 / 0.53
# disagg at 32 / 128 streams on the quiet VM, 2026-12-05). The GPU machine's 16 cores answer
# it; no GPU is used (mlc-compat engines on the synthetic llama-1b schedule, benchmark-only).
# Carry only .gpuwhl (aiohttp and orjson are in it since this session's gpu_wheels.sh).
# Usage: source .gpuwhl/prep.sh; bash mlc_relay.sh "$OUT"   (from main's root)
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nproc | tee $O/cores.txt
python3 -c "import aiohttp, orjson, uvloop; print('aiohttp', aiohttp.__version__)" || exit 1
timeout ${T:-500} python3 -m microserving.cli bench mlc-relay --streams 1 32 128 \
  --rounds ${ROUNDS:-2} --duration-s ${D:-6} --warmup-s 2 --out /tmp/r63 > $O/relay.log 2>&1
echo "rc=$?"; grep -E "^\| |raw round" $O/relay.log | cut -c1-260
cp /tmp/r63/mlc_relay.json $O/ 2>/dev/null
echo "== end $(date +%T)"
