# Prepared for the next device loan (not run on 2026-12-05: no device was lent).
# `microserving serve` (the router in the gateway's process) against the split stack on one
# H200, side by side in one call: `scripts/gpu_run.sh` step `capacity`, once per topology,
# alternating, ROUNDS times (default 2) at STREAMS (default 1 / 64 / 128; the engine alone
# measured in each). Results are packed after every step, so a call cut off at its limit still
# returns what finished. Usage on the device: bash serve.sh "$OUT"
O=$1; R=/tmp/serve16; rm -rf $R; mkdir -p $R "$O"
pack() { (cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz .); }
for round in $(seq 1 "${ROUNDS:-2}"); do
  for topology in split serve; do
    # serve: each of the 4 gateway workers runs its own router (no router processes)
    extra=""; replicas=2; [ $topology = serve ] && extra="--embed-router" && replicas=1
    echo "== $topology round $round $(date +%T)"
    PYTHONPATH=$PWD:/tmp/site OUT=$R/$topology-$round GPU_STEPS=capacity GPU_ROUNDS=1 \
      GPU_REQUESTS_PER_STREAM=4 GPU_CAPACITY_TIMEOUT_S=${CAP_T:-240} \
      GPU_STREAMS="${STREAMS:-1 64 128}" GPU_ROUTER_REPLICAS=$replicas GPU_CAPACITY_ARGS="$extra" \
      bash scripts/gpu_run.sh > $R/$topology-$round.log 2>&1
    grep -E "^\| (round|disagg)" $R/$topology-$round/capacity.log; pack
  done
done
echo "== end $(date +%T)"
