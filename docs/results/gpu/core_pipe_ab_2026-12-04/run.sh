# GPU call: gpu tests (new tree), then the capacity bench (round-robin, 64 and 128 streams,
# one round) for the new tree and the old one (.ab/old), side by side
O=$1; R=/tmp/r5; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== tests $(date +%T)"
timeout ${T_TESTS:-170} python3 -m pytest -q tests/gpu -p no:cacheprovider > $R/gpu_tests.log 2>&1; tail -2 $R/gpu_tests.log
grep -E "^(FAILED|ERROR)" $R/gpu_tests.log | head
for tree in new old; do
  dir=$PWD; [ $tree = old ] && dir=$PWD/.ab/old
  echo "== $tree $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site env OUT=$R/$tree GPU_STEPS=ab AB_TIMEOUT_S=200 AB_ENV=MICROSERVING_SHIM_MIXED_CUDA_GRAPHS AB_VALUES=true AB_PATTERNS=round-robin AB_STREAMS="64 128" AB_ROUNDS=1 bash scripts/gpu_run.sh > $R/ab_$tree.log 2>&1)
  grep -v "^|" $R/$tree/ab_true.log | grep -v "^CPU"; grep "^| round" $R/$tree/ab_true.log
  find $R/$tree -name "*.log" -path "*logs*" -size +2M -delete 2>/dev/null
done
echo "== end $(date +%T)"
