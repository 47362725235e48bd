# Prepared 2026-12-08 (twenty-eighth session): disagg's second token at one stream came 2.5-4.8
# ms after the first at p50 and 16-40 ms at p99 in runs 71-73 (round-robin's: 0.6 / 0.8-3.3 ms;
# on the VM's synthetic engines disagg's is 1.2 / 1.7). The second token is D's first step
# after the KV lands, so each slow one should show in P's send (its phases: hold, claim,
# transfer, confirmation, logged at INFO per RemoteSend) or in D's wait for it. Disagg at one
# stream, 60 requests, two rounds, the shims at INFO; P's and D's logs kept. Either card.
# Usage: source .gpuwhl/prep.sh; [ROUNDS=2 REQ=60] bash first.sh "$OUT"
O=$1; mkdir -p "$O"; export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/card.txt"
timeout ${L_T:-400} python3 -m microserving.cli bench capacity --backend embedded \
  --model llama-1b --device cuda --input-len 256 --output-len 256 --alone-each-round \
  --gateway-workers 4 --router-replicas 2 --patterns disagg --streams 1 --rounds ${ROUNDS:-2} \
  --requests-per-stream ${REQ:-60} --min-requests ${REQ:-60} --shim-arg=--log-level=INFO \
  --out "$O/bench" > "$O/second.log" 2>&1
echo "rc=$?"; grep -h -E "^host at|round [0-9]+|^\| " "$O/second.log" | cut -c1-240
python3 - "$O/bench/cells.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    c = json.loads(line)
    print(c["pattern"], c["streams"], c["round"], {k: round(c[k], 2) for k in (
        "ttft_added_p50_ms", "second_token_p50_ms", "second_token_p99_ms", "itl_p99_ms")})
PY
grep -h "RemoteSend" "$O"/bench/logs/*prefill* 2>/dev/null | tail -5 | cut -c1-300
gzip -9 "$O"/bench/logs/*.log  # the bench writes into $OUT as it goes: a call cut short keeps it
echo "== end $(date +%T)"
