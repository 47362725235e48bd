# The script ran twice: old before new in each pair (the first six lines, old1..new3), then new before old (rnew1..rold3).
# old = 8beb36f (the tree of GPU runs 60-61, .ab/r61: git archive of engine_shim router gateway microserving colocated bench), new = main at 3ad4ce7.
export PATH=/work/main/.venv/bin:$PATH
for i in 1 2 3; do
 for t in new old; do
  P=/work/main; [ $t = old ] && P=/work/main/.ab/r61
  (cd $P && PYTHONPATH=$P timeout 200 python -m microserving.cli bench capacity --patterns round-robin disagg --streams 1 --rounds 1 --duration-s 6 --warmup-s 1 --out /tmp/ab61/r$t$i > /tmp/ab61/r$t$i.log 2>&1)
  echo "r$t$i $(grep -h -E 'round [0-9]+:' /tmp/ab61/r$t$i.log | sed -E 's/.*(round-robin|disagg).*first token ([^,]*), CPU ([0-9.]+).*/\1 \2 cpu \3/' | tr '\n' ' ')" >> /tmp/ab61/summary
 done
done
echo done >> /tmp/ab61/summary
