set -u
OUT=/tmp/abg
for r in 1 2 3; do
  for tree in new head; do
    dir=/work/main; [ $tree = head ] && dir=/work/main/.ab/head
    for len in 16 256; do
    (cd $dir && PYTHONPATH=$dir timeout 400 /work/main/.venv/bin/python -m microserving.cli bench capacity --streams 64 --patterns round-robin disagg --output-len $len --duration-s 8 --warmup-s 2 --out $OUT/$tree-$len-$r > $OUT/$tree-$len-$r.log 2>&1)
    echo "$tree len=$len r=$r"; grep -E "^\| (round|disagg)" $OUT/$tree-$len-$r.log
    done
  done
done
