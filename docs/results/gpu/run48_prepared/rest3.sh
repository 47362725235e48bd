# Prepared 2026-12-06 (eighteenth session): the rest of issue 16's table over three rounds
# on this tree (a prefill shim's default chunk is now 2048): round-robin at 32 / 64 / 128
# streams, then disagg at 32 (run 47 gave disagg at 64 and 128 over three rounds), the engine
# alone right before each cell. Usage: [PARTS=disagg32] bash rest3.sh "$OUT"
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
run() {  # tag, limit, then bench arguments
  local tag=$1 limit=$2; shift 2
  echo "== $tag $(date +%T)"
  timeout $limit python3 -m microserving.cli bench capacity --backend embedded --model llama-1b \
    --device cuda --input-len 256 --output-len 256 --alone-each-round --gateway-workers 4 \
    --router-replicas 2 --rounds 3 --requests-per-stream 6 --min-requests 30 \
    --out /tmp/r48-$tag "$@" > $O/$tag.log 2>&1
  echo "rc=$? $(date +%T)"; mkdir -p $O/$tag; cp /tmp/r48-$tag/cells.jsonl /tmp/r48-$tag/capacity.json $O/$tag/ 2>/dev/null
  grep -h -E "^\| |round [0-9]" $O/$tag.log | cut -c1-300
}
# PARTS: which of the two to run (default both), e.g. PARTS=disagg32
case " ${PARTS:-rr disagg32} " in *" rr "*) run rr ${R_T:-330} --patterns round-robin --streams 32 64 128;; esac
case " ${PARTS:-rr disagg32} " in *" disagg32 "*) run disagg32 ${D_T:-200} --patterns disagg --streams 32;; esac
echo "== end $(date +%T)"
