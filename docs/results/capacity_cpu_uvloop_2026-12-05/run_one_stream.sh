set -u
OUT=/tmp/abu1
for r in 1 2; do
  for loop in uvloop asyncio; do
    (cd /work/main && timeout 400 .venv/bin/python -m microserving.cli bench capacity --streams 1 --patterns round-robin disagg --duration-s 8 --warmup-s 2 --shim-arg=--event-loop=$loop --out $OUT/$loop-$r > $OUT/$loop-$r.log 2>&1)
    echo "$loop r=$r"; grep -E "^\| (round|disagg)" $OUT/$loop-$r.log
  done
done
