#!/usr/bin/env bash
# Side by side on one machine in one run: the serving path before issue 16 (e0f1d65, with the
# capacity bench) and after (main), interleaved, 3 rounds.
PY=/work/main/.venv/bin/python
for round in 1 2 3; do
  for version in before after after-nobudget; do
    case $version in
      before) dir=/work/wt-before; extra=() ;;
      after) dir=/work/main; extra=() ;;
      after-nobudget) dir=/work/main; extra=(--shim-arg=--stream-updates-per-s=0) ;;
    esac
    (cd $dir && PYTHONPATH=$dir timeout 300 $PY -m microserving.cli bench capacity --out /tmp/sbs/$version-$round \
      --patterns round-robin disagg --streams 64 --duration-s 8 --warmup-s 2 "${extra[@]}" > /tmp/sbs/$version-$round.log 2>&1)
    echo "$version $round done $(date +%T)"
  done
done
