# GPU call 1 (2026-12-05, fifth session): `microserving serve` (the router in each of the 4
# gateway workers) and the split stack (4 gateway workers, 2 router replicas), one round each,
# back to back on one host: `scripts/gpu_run.sh` step `capacity` (the engine alone and the whole
# stack, round-robin and disagg 1P:1D, 1/32/64/128 streams). Then, if time is left, disagg at 1
# and 128 streams with P logging each NIXL send's phases (run15's sends.sh).
# Usage on the device: bash call1.sh "$OUT" (STREAMS="1 64 128" for fewer cells). Results are
# packed after every step, so a call cut off at its limit still returns what finished.
O=$1; R=/tmp/run16; rm -rf $R; mkdir -p $R "$O"; t0=$(date +%s)
pack() { (cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz .); }
for topology in split serve; do
  extra=""; replicas=2; [ $topology = serve ] && extra="--embed-router" && replicas=1
  echo "== $topology $(date +%T)"
  PYTHONPATH=$PWD:/tmp/site OUT=$R/$topology GPU_STEPS=capacity GPU_ROUNDS=1 \
    GPU_REQUESTS_PER_STREAM=4 GPU_CAPACITY_TIMEOUT_S=${CAP_T:-240} \
    GPU_STREAMS="${STREAMS:-1 32 64 128}" GPU_ROUTER_REPLICAS=$replicas GPU_CAPACITY_ARGS="$extra" \
    bash scripts/gpu_run.sh > $R/$topology.log 2>&1
  grep -E "^\| (round|disagg)" $R/$topology/capacity.log; pack
done
left=$(( ${BUDGET_S:-570} - ($(date +%s) - t0) ))
if [ $left -gt 100 ]; then
  echo "== sends $(date +%T) ($left s left)"
  SENDS_T=$((left - 15)) bash docs/results/gpu/run15_2026-12-05/sends.sh $R/sends > $R/sends.log 2>&1
  tail -5 $R/sends.log
fi
pack; echo "== end $(date +%T)"
