# Prepared 2026-12-07 (twenty-third session): the same-GPU NIXL write posted at the send's
# launch, ordered after it on the device (1135849), against the tree before it (.ab/s56),
# taking turns: disagg at 32 streams (new, old, new) and 64 (new, old), P at INFO (its
# RemoteSend phases, run56_prepared/phases.py). First the GPU tests of the change.
# Usage: bash first.sh "$OUT"   (from the new tree's root, .ab/s56 carried)
O=$1; mkdir -p "$O"; NEW=$PWD; OLD=$PWD/.ab/s56
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/card.txt
export MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== gpu tests $(date +%T)"
PYTHONPATH=$NEW:/tmp/site timeout ${T_T:-150} python3 -m pytest -q -p no:cacheprovider tests/gpu \
  -k "ordered_after or pd_between" 2>&1 | tail -6
cell() {  # tag, tree, streams
  local R=/tmp/r57-$1; rm -rf $R
  echo "== $1 $(date +%T)"
  (cd $2 && PYTHONPATH=$2:/tmp/site timeout ${T_C:-150} python3 -m microserving.cli bench capacity \
    --backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256 \
    --alone-each-round --gateway-workers 4 --router-replicas 2 --patterns disagg --streams $3 \
    --rounds 1 --requests-per-stream 6 --min-requests 30 --shim-arg=--log-level=INFO --out $R \
    > $O/cell-$1.log 2>&1)
  echo "rc=$?"; grep -h -E "^  disagg|shim-" $O/cell-$1.log | cut -c1-200
  python3 $NEW/docs/results/gpu/run56_prepared/phases.py $R/logs/disagg-shim-prefill.log
  python3 -c "
import json
for l in open('$R/cells.jsonl'):
    d = json.loads(l); c = d['engine_calls']
    print('  RemoteSend mean', round(c['remote_send']['mean_ms'], 1), 'PrepRecv mean', round(c['prep_recv']['mean_ms'], 1),
          'TTFT p50', round(d['ttft_p50_ms'], 1), 'second token p50/p99', round(d['second_token_p50_ms'], 1),
          round(d['second_token_p99_ms'], 1), 'ITL p50', round(d['itl_p50_ms'], 2))"
  cp $R/cells.jsonl $O/cells-$1.jsonl 2>/dev/null
}
cell new32a $NEW 32; cell old32 $OLD 32; cell new32b $NEW 32
cell new64 $NEW 64; cell old64 $OLD 64
(cd $O && tar czf cells.tgz cell-*.log cells-*.jsonl && rm -f cell-*.log cells-*.jsonl)
echo "== end $(date +%T)"
