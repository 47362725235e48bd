# Prepared 2026-12-05 (ninth session) for the next loan; changed 2026-12-06 (tenth session)
# as device time ran short (refusals cost most of a third of it): call 1 is now P's send with
# D's PrepRecv side by side (send_ahead.sh: the router's MICROSERVING_ROUTER_SEND_AHEAD false /
# true, disagg at 1 and 64 streams, then round-robin and disagg at one stream in one run);
# call 2 asks whether CUDA MPS closes disagg's gap on one GPU now that the stall is fixed (run
# 17's MPS call stalled): run 16's mps.sh at 64 streams. Run 20's table with longer rounds
# (CAP_ROUNDS=3 CAP_T=560 CAP_REQUESTS_PER_STREAM=8 bash docs/results/gpu/run15_2026-12-05/full.sh)
# waits for a later loan.
# Usage on the device: bash calls.sh 1 "$OUT"   then   bash calls.sh 2 "$OUT"
case "$1" in
  1) bash docs/results/gpu/run21_prepared/send_ahead.sh "$2" ;;
  2) STREAMS=64 MPS_T=130 bash docs/results/gpu/run16_2026-12-05/mps.sh "$2/mps64" ;;
esac
