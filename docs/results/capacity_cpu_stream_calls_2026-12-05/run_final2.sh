set -u
OUT=${1:-/tmp/ab1}
for r in 1 2; do
  for tree in new base; do
    dir=/work/main; [ $tree = base ] && dir=/work/main/.ab/base
    (cd $dir && PYTHONPATH=$dir timeout 400 /work/main/.venv/bin/python -m microserving.cli bench capacity --streams 1 64 --patterns disagg round-robin --duration-s 6 --warmup-s 2 --out $OUT/$tree-$r > $OUT/$tree-$r.log 2>&1)
    echo "$tree $r"; grep -E "^\| (round|disagg)" $OUT/$tree-$r.log
  done
done
