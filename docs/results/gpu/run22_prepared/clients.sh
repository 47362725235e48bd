# Prepared 2026-12-06 (eleventh session). Round-robin at 64 and 128 streams, two rounds, the
# gateway's four workers on one shared socket (MICROSERVING_GATEWAY_REUSE_PORT=false, uvicorn's
# supervisor) and on a socket each (true, the new default), each value on a stack of its own in
# turn (bench capacity --ab-env, the other order each round), and each of those driven from one
# client process and from four (--client-processes 1 4), every round's cells against the engine
# alone run right before them (--alone-each-round). Usage on the device: bash clients.sh "$OUT"
O=$1; R=/tmp/run22_clients; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== ab $(date +%T)"
PYTHONPATH=$PWD:/tmp/site OUT=$R GPU_STEPS=ab AB_ENV=MICROSERVING_GATEWAY_REUSE_PORT AB_VALUES="false true" \
  AB_PATTERNS=round-robin AB_STREAMS="64 128" AB_ROUNDS=${CP_ROUNDS:-2} \
  AB_REQUESTS_PER_STREAM=${CP_REQUESTS_PER_STREAM:-6} AB_TIMEOUT_S=${CP_T:-560} \
  AB_ARGS="--client-processes 1 4" bash scripts/gpu_run.sh > $R/run.log 2>&1
grep -h -E "^\| round" $R/ab.log; grep -h "round" $R/ab.log | grep -c "errors"
echo "== end $(date +%T)"
