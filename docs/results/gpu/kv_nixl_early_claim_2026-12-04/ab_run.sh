# side by side on one host: kv_bench (nixl) and disagg at 1 and 64 streams, new tree then old
O=$1; R=/tmp/r; rm -rf $R /tmp/kv_bench_*; mkdir -p $R "$O"
NEW=$PWD; OLD=$PWD/.ab/old
finish() { cd $R && tar czf $O/res.tgz . ; }
trap finish EXIT
run_tree() {
  name=$1; dir=$2; patterns=$3
  echo "== $name kv $(date +%T)"
  rm -rf /tmp/kv_bench_*
  (cd $dir && PYTHONPATH=$dir:/tmp/site timeout 150 python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 1024 8176 --paths nixl --num-pages 4096 > $R/kv_$name.json 2> $R/kv_$name.log)
  grep '^{"model"' $R/kv_$name.log | cut -c1-220
  L=$(ls -td /tmp/kv_bench_* | head -1); cp $L/prefill.log $R/kv_${name}_prefill.log
  echo "== $name ab $(date +%T)"
  (cd $dir && env OUT=$R/$name GPU_STEPS=ab AB_TIMEOUT_S=200 AB_ENV=MICROSERVING_SHIM_KV_TRANSPORT AB_VALUES=nixl AB_PATTERNS="$patterns" AB_STREAMS="1 64" AB_ROUNDS=1 AB_ARGS="--shim-arg=--log-level=INFO" bash scripts/gpu_run.sh > $R/ab_$name.log 2>&1)
  grep "^| disagg\|^| round" $R/ab_$name.log
  find $R/$name -name "*.log" -path "*logs*" ! -name "*prefill*" ! -name "*decode*" -delete 2>/dev/null
}
run_tree new $NEW disagg
run_tree old $OLD disagg
echo "== rr $(date +%T)"
(cd $NEW && env OUT=$R/rr GPU_STEPS=ab AB_TIMEOUT_S=120 AB_ENV=MICROSERVING_SHIM_KV_TRANSPORT AB_VALUES=nixl AB_PATTERNS=round-robin AB_STREAMS=1 AB_ROUNDS=1 bash scripts/gpu_run.sh > $R/ab_rr.log 2>&1)
grep "^| round" $R/ab_rr.log
find $R/rr -name "*.log" -path "*logs*" -delete 2>/dev/null
echo "== end $(date +%T)"
