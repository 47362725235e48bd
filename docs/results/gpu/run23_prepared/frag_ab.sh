# Prepared 2026-12-06 (twelfth session). The allocator's runs on a recycled KV pool: the tree
# of 06d1412 with the block manager before 531c8d1 (strict LRU; carried as .ab/b24) against
# this tree (a run goes on through the next idle pages), side by side on one host. A 2 GiB
# pool (4,096 pages, 128 requests of 512 tokens) recycles early in the cell; `scripts/gpu_run.sh`
# step `capacity`, disagg at 64 streams, eight requests a stream, one round per run, the order
# base, new, new, base, each against the engine alone run right before it; P logs each send's
# phases and the runs of slots of its receiver's reservation (INFO). The results are packed
# after every run (a call cut short keeps the runs it finished).
# Usage on the device (carry .ab/b24): bash frag_ab.sh "$OUT"
O=$1; R=/tmp/run23_frag; rm -rf $R; mkdir -p $R "$O"
finish() { (cd $R && find . -name "*.log" -path "*logs*" -size +4M -delete; tar czf $O/res.tgz .) ; }
trap finish EXIT
here=$PWD
i=0
for tree in base new new base; do
  i=$((i + 1)); dir=$here; [ $tree = base ] && dir=$here/.ab/b24
  echo "== $i $tree $(date +%T)"
  (cd $dir && PYTHONPATH=/tmp/site OUT=$R/${i}_$tree GPU_STEPS=capacity GPU_STREAMS="${F_STREAMS:-64}" GPU_ROUNDS=${F_ROUNDS:-1} \
    GPU_KV_MB=${F_KV_MB:-2048} GPU_REQUESTS_PER_STREAM=${F_REQUESTS_PER_STREAM:-8} GPU_CAPACITY_TIMEOUT_S=${F_T:-100} \
    GPU_CAPACITY_ARGS="--patterns disagg --shim-arg=--log-level=INFO" bash scripts/gpu_run.sh > $R/${i}_$tree.log 2>&1)
  grep -h -E "^  disagg|yardstick" $R/${i}_$tree/capacity.log
  grep -ho "([0-9]* runs of slots)" $R/${i}_$tree/capacity/logs/*prefill*.log | sort | uniq -c | sort -rn | head -4
  finish
done
echo "== end $(date +%T)"
