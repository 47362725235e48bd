# Prepared 2026-12-05 (ninth session) for the next loan. Run 20's table had 2-3.5 s rounds
# (GPU_REQUESTS_PER_STREAM=4), and one round of three at 128 streams fell to 0.78 where the
# others made 0.88-0.92: call 1 is the same table with rounds twice as long. Call 2 asks whether
# CUDA MPS closes disagg's gap on one GPU now that the stall is fixed (run 17's MPS call
# stalled): run 16's mps.sh at 64 and at 128 streams.
# Usage on the device: bash calls.sh 1 "$OUT"   then   bash calls.sh 2 "$OUT"
case "$1" in
  1) CAP_ROUNDS=3 CAP_T=560 CAP_REQUESTS_PER_STREAM=8 bash docs/results/gpu/run15_2026-12-05/full.sh "$2" ;;
  2) STREAMS=64 MPS_T=130 bash docs/results/gpu/run16_2026-12-05/mps.sh "$2/mps64"
     STREAMS=128 MPS_T=130 bash docs/results/gpu/run16_2026-12-05/mps.sh "$2/mps128" ;;
esac
