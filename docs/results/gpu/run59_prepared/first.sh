# Prepared 2026-12-07 (twenty-third session): an experiment, not on main. The engine core takes
# the calls that came in while a step waited for the device between collecting that step's
# forward and scheduling the next (calls_in_step.patch: LLMEngine.before_schedule, run by
# CoreLoop), where it takes them only after launching the next forward: a RemoteSend that
# reaches a busy P mid-step then joins the forward launched next, not the one after (run 56:
# P's core took the call 3-7 ms p50 under 32-stream disagg load; P's steps 4.7-6.3 ms).
# On the CPU (overlap forced on) tests/engine, tests/shim and the router's token-exact tests
# fail as without it but for test_core_loop_busy's accounting (polls inside a step now count
# in the step's time too: the test's sum double-counts them).
# Here: the patched tree's GPU PD tests, then disagg at 32 and 64 streams, P at INFO, taking
# turns with main (new, old, new at 32; new, old at 64), each against a cold engine alone.
# Usage: bash first.sh "$OUT"   (from main's root)
O=$1; mkdir -p "$O"; OLD=$PWD; NEW=/tmp/cbs
rm -rf $NEW && mkdir -p $NEW && cp -r engine_shim microserving router gateway colocated bench tests \
  pyproject.toml docs $NEW/ 2>/dev/null; (cd $NEW && patch -p1 -s < $OLD/docs/results/gpu/run59_prepared/calls_in_step.patch) || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/card.txt
export MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
echo "== gpu tests (patched) $(date +%T)"
(cd $NEW && PYTHONPATH=$NEW:/tmp/site timeout ${T_T:-150} python3 -m pytest -q -p no:cacheprovider tests/gpu \
  -k "pd_between or in_process_pd or chained or continuation" 2>&1 | tail -4)
cell() {  # tag, tree, streams
  local R=/tmp/r59-$1; rm -rf $R
  echo "== $1 $(date +%T)"
  (cd $2 && PYTHONPATH=$2:/tmp/site timeout ${T_C:-150} python3 -m microserving.cli bench capacity \
    --backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256 \
    --alone-each-round --gateway-workers 4 --router-replicas 2 --patterns disagg --streams $3 \
    --rounds 1 --requests-per-stream 6 --min-requests 30 --shim-arg=--log-level=INFO --out $R \
    > $O/cell-$1.log 2>&1)
  echo "rc=$?"; grep -h -E "^  disagg|alone|shim-" $O/cell-$1.log | cut -c1-200
  python3 $OLD/docs/results/gpu/run56_prepared/phases.py $R/logs/disagg-shim-prefill.log
  python3 -c "
import json
for l in open('$R/cells.jsonl'):
    d = json.loads(l); c = d['engine_calls']
    print('  RemoteSend mean', round(c['remote_send']['mean_ms'], 1), 'PrepRecv mean', round(c['prep_recv']['mean_ms'], 1),
          'TTFT p50', round(d['ttft_p50_ms'], 1), 'second token p50', round(d['second_token_p50_ms'], 1))"
  cp $R/cells.jsonl $O/cells-$1.jsonl 2>/dev/null
}
cell new32a $NEW 32; cell old32 $OLD 32; cell new32b $NEW 32
cell new64 $NEW 64; cell old64 $OLD 64
(cd $O && tar czf cells.tgz cell-*.log cells-*.jsonl && rm -f cell-*.log cells-*.jsonl)
echo "== end $(date +%T)"
