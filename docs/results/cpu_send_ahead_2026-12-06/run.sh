# P's RemoteSend made with D's PrepRecv (send_ahead, the default) against the calls in turn
# (--no-send-ahead), same tree, alternating: disagg 1P:1D on the synthetic engines (the
# push path: no NIXL pool), 1 and 64 streams, two rounds a run, two runs each (on1, off1, on2,
# off2). Usage: bash run.sh OUT_DIR
for i in 1 2; do
  for mode in on off; do
    arg=""; [ $mode = off ] && arg="--router-arg=--no-send-ahead"
    python -m microserving.cli bench capacity --patterns disagg --streams 1 64 --rounds 2 \
      --duration-s 6 --warmup-s 2 $arg --out "$1/$mode$i"
  done
done
