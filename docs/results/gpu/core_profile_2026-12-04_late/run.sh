# GPU call: the capacity bench (round-robin, 64 and 128 streams, one round) for the new tree
# (with py-spy of the stack and of the engine alone at 128) and the old one (.ab/old)
O=$1; R=/tmp/r1; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
for tree in new old; do
  dir=$PWD; args=""
  [ $tree = old ] && dir=$PWD/.ab/old
  [ $tree = new ] && args="--profile-s 4 --py-spy-arg=--idle"
  echo "== $tree $(date +%T)"
  (cd $dir && PYTHONPATH=$dir:/tmp/site env OUT=$R/$tree GPU_STEPS=ab AB_TIMEOUT_S=${AB_T:-230} AB_ENV=MICROSERVING_AB AB_VALUES=x AB_PATTERNS=round-robin AB_STREAMS="64 128" AB_ROUNDS=1 AB_ARGS="$args" bash scripts/gpu_run.sh > $R/ab_$tree.log 2>&1)
  grep -v "^|" $R/$tree/ab_x.log | grep -v "^CPU"; grep "^| round" $R/$tree/ab_x.log
done
echo "== end $(date +%T)"
