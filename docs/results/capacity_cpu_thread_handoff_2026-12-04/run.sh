set -u
for r in 1 2; do
  for tree in new old; do
    dir=/work/main; [ $tree = old ] && dir=/work/main/.ab/old
    (cd $dir && PYTHONPATH=$dir timeout 400 /work/main/.venv/bin/python -m microserving.cli bench capacity --streams 64 --patterns round-robin disagg --duration-s 8 --warmup-s 2 --out /tmp/cpuab2/$tree-$r > /tmp/cpuab2/$tree-$r.log 2>&1)
    echo "$tree $r"; grep -E "^\| (round|disagg)" /tmp/cpuab2/$tree-$r.log
  done
done
