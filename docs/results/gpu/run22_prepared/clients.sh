# Prepared 2026-12-06 (eleventh session). The capacity benchmark's closed loop from one client
# process and from four (`bench capacity --client-processes 1 4`: the two take turns on the
# same stacks each round, in the other order each round), round-robin and disagg 1P:1D at 64
# and 128 streams, three rounds of eight requests a stream, with the gateway's first-token time
# beside the router's and the client's. Usage on the device: bash clients.sh "$OUT"
O=$1; R=/tmp/run22_clients; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== capacity $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=capacity GPU_STREAMS="${CP_STREAMS:-64 128}" \
  GPU_ROUNDS=${CP_ROUNDS:-3} GPU_REQUESTS_PER_STREAM=${CP_REQUESTS_PER_STREAM:-8} \
  GPU_CAPACITY_TIMEOUT_S=${CP_T:-560} GPU_CAPACITY_ARGS="--client-processes ${CLIENT_PROCESSES:-1 4}" \
  bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| (round|disagg)" $R/capacity/table.md; grep -c "errors" $R/capacity.log
echo "== end $(date +%T)"
