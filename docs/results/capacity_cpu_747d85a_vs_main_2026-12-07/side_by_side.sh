#!/usr/bin/env bash
# 747d85a (the docs' latest capacity table) against main (67c4757), taking turns at 64 streams:
# rounds 1-2 with --patterns round-robin disagg and 'for round in 1 2', rounds 3-5 as below.
PY=/work/main/.venv/bin/python
mkdir -p /tmp/sbs
for round in 3 4 5; do
  for version in old new; do
    case $version in old) dir=/tmp/old747 ;; new) dir=/work/main ;; esac
    (cd $dir && PYTHONPATH=$dir timeout 280 $PY -m microserving.cli bench capacity --out /tmp/sbs/$version-$round \
      --patterns round-robin --streams 64 --duration-s 10 --warmup-s 2 > /tmp/sbs/$version-$round.log 2>&1)
    echo "$version $round: $(grep -E '^\| (round-robin|disagg) ' /tmp/sbs/$version-$round.log | awk -F'|' '{printf "%s %s ratio %s cpu %s; ", $2, $3, $6, $(NF-4)}')"
  done
done
