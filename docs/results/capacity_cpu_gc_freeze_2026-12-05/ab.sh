for i in 1 2; do
 for t in base new; do
  d=/work/main; [ $t = base ] && d=/work/main/.ab/base
  (cd $d && PYTHONPATH=$d timeout 500 /work/main/.venv/bin/python -m microserving.cli bench capacity --patterns round-robin disagg --streams 64 --rounds 2 --duration-s 8 --warmup-s 2 --out /tmp/abgc/$t$i > /tmp/abgc_$t$i.log 2>&1)
 done
done
