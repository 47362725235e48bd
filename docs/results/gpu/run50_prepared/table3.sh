# Prepared 2026-12-07 (twenty-first session), for the first H200 lent since run 22: issue 16's
# table on the current tree over three rounds (the engine alone right before every cell), and
# issue 21's KV figures (kv_bench: nixl beside shm and gRPC at 1,024 and 8,176 tokens, then a
# 256-token NIXL send with 64 streams decoding on D). One part a call:
#   PART=rr|disagg|kv bash table3.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $O/machine.txt
table() {  # pattern, limit
  echo "== $1 $(date +%T)"
  timeout $2 python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
    --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
    --router-replicas 2 --patterns $1 --streams ${STREAMS:-1 32 64 128} --rounds ${ROUNDS:-3} \
    --requests-per-stream 6 --min-requests 30 --out /tmp/r50-$1 > $O/$1.log 2>&1
  echo "rc=$? $(date +%T)"; cp /tmp/r50-$1/cells.jsonl /tmp/r50-$1/capacity.json $O/ 2>/dev/null
  grep -h -E "^\| |round [0-9]" $O/$1.log | cut -c1-300
}
case ${PART:?PART=rr, disagg or kv} in
  rr) table round-robin ${T:-560};;
  disagg) table disagg ${T:-560};;
  kv)
    echo "== kv idle $(date +%T)"
    timeout ${K_T:-300} python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 1024 8176 \
      --num-pages 4096 > $O/kv.json 2> $O/kv.log; echo "rc=$?"; tail -4 $O/kv.log
    echo "== kv load $(date +%T)"
    timeout ${L_T:-150} python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 256 \
      --num-pages 8192 --paths nixl --receiver-load 64 --receiver-load-via stream > $O/load.json \
      2> $O/load.log; echo "rc=$?"; tail -3 $O/load.log
    python3 - "$O" <<'PY'
import json, sys
for kind in ("kv", "load"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/{kind}.json"))["rows"]
    except Exception as error:
        print(kind, "no rows:", error); continue
    for r in rows:
        print(kind, {k: v for k, v in r.items() if not isinstance(v, (list, dict)) or k.endswith("phases")})
PY
    ;;
esac
echo "== end $(date +%T)"
