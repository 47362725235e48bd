# Prepared 2026-12-06 (thirteenth session). Where one stream's first token goes on the GPU:
# `bench capacity` at one stream, round-robin and disagg, the split stack and then the router in
# the gateway's process (--embed-router), on a tree with temporary timestamps at every hop
# (stamps.patch + _stamp.py here: CLOCK_MONOTONIC, one file per process), then an2.py's
# per-request timeline (median time from the client's POST to each event's first occurrence).
# Usage on the device: bash lat.sh "$OUT"
O=$1; R=/tmp/run25_lat; rm -rf $R; mkdir -p $R "$O"
H=$(dirname "$0")
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz --exclude='st_*' . ; }
trap finish EXIT
for mode in split embed; do
  echo "== $mode $(date +%T)"
  # (run 25 ran without GPU_ROUTER_REPLICAS=1, and its embed half stopped at the benchmark's
  # refusal of --router-replicas with --embed-router)
  extra=""; replicas=2; [ $mode = embed ] && extra="--embed-router" && replicas=1
  GPU_ROUTER_REPLICAS=$replicas MSSTAMP_DIR=$R/st_$mode PYTHONPATH=$PWD:/tmp/site OUT=$R/$mode GPU_STEPS=capacity GPU_STREAMS=1 GPU_ROUNDS=1 \
    GPU_REQUESTS_PER_STREAM=${L_REQUESTS:-30} GPU_MIN_REQUESTS=30 GPU_CAPACITY_TIMEOUT_S=${L_T:-240} \
    GPU_CAPACITY_ARGS="--patterns round-robin disagg $extra" bash scripts/gpu_run.sh > $R/run_$mode.log 2>&1
  grep -h -E "^\| (round|disagg)" $R/$mode/capacity.log
  for p in shim-both shim-decode; do
    python3 $H/an2.py $R/st_$mode $p > $R/timeline_${mode}_$p.txt 2>&1; cp $R/timeline_${mode}_$p.txt $O/
    head -1 $R/timeline_${mode}_$p.txt; tail -1 $R/timeline_${mode}_$p.txt
  done
done
echo "== end $(date +%T)"
