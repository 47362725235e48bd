# GPU call: gpu tests, then the capacity bench with mixed-step graphs off and on, side by side
O=$1; R=/tmp/r; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && tar czf $O/res.tgz . ; }
trap finish EXIT
echo "== tests $(date +%T)"
timeout ${T_TESTS:-200} python3 -m pytest -q tests/gpu -p no:cacheprovider > $R/gpu_tests.log 2>&1; tail -4 $R/gpu_tests.log
grep -E "^(FAILED|ERROR)|Error" $R/gpu_tests.log | head -20
[ -n "${SKIP_AB:-}" ] && exit 0
echo "== ab $(date +%T)"
env OUT=$R/ab GPU_STEPS=ab AB_TIMEOUT_S=${AB_T:-220} AB_ENV=MICROSERVING_SHIM_MIXED_CUDA_GRAPHS AB_VALUES="${AB_VALUES:-false true}" AB_PATTERNS="${AB_PATTERNS:-round-robin}" AB_STREAMS="${AB_STREAMS:-64 128}" AB_ROUNDS=${AB_ROUNDS:-1} bash scripts/gpu_run.sh > $R/ab.log 2>&1
grep "^| disagg\|^| round\|engine alone" $R/ab.log
find $R/ab -name "*.log" -path "*logs*" -size +2M -delete 2>/dev/null
echo "== end $(date +%T)"
