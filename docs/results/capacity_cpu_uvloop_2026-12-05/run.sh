set -u
OUT=/tmp/abu
for r in 1 2 3; do
  for loop in uvloop asyncio; do
    for len in 256 16; do
    (cd /work/main && timeout 400 .venv/bin/python -m microserving.cli bench capacity --streams 64 --patterns round-robin disagg --output-len $len --duration-s 8 --warmup-s 2 --shim-arg=--event-loop=$loop --out $OUT/$loop-$len-$r > $OUT/$loop-$len-$r.log 2>&1)
    echo "$loop len=$len r=$r"; grep -E "^\| (round|disagg)" $OUT/$loop-$len-$r.log
    done
  done
done
