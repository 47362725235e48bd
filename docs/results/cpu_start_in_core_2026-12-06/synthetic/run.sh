# The same two trees on the synthetic engines (the push path: D's waiting start begins with
# the last pushed chunk), disagg at 1 and 64 streams, two rounds a run, alternating, two runs
# each. Usage: bash run.sh BASE_TREE HEAD_TREE OUT_DIR
for i in 1 2; do for side in base head; do
  tree=$1; [ $side = head ] && tree=$2
  PYTHONPATH=$tree python -m microserving.cli bench capacity --patterns disagg --streams 1 64 --rounds 2 \
    --duration-s 6 --warmup-s 2 --out "$3/$side$i"
done; done
