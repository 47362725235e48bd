# GPU call (2026-12-05, sixth session): does CUDA MPS close disagg's gap on one GPU? Run 15's
# profile found P's core waiting in Event.synchronize inside its prefill graph's launch: P and
# D are two processes with two CUDA contexts on one H200, and without MPS the device runs one
# context's kernels at a time. Disagg 1P:1D (and round-robin as the control) at 128 streams,
# one round each, without the MPS daemon and then with it (every process started after the
# daemon, the engine-alone baseline too, is an MPS client), back to back on one host. Prints
# whether the daemon could start; without it only the first half runs.
# Usage on the device: bash mps.sh "$OUT" (STREAMS, default 128; MPS_T, seconds a half)
O=$1; R=/tmp/mps16; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +2M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
export CUDA_MPS_PIPE_DIRECTORY=$R/mps_pipe CUDA_MPS_LOG_DIRECTORY=$R/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
half() {  # $1: off | on
  PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 timeout ${MPS_T:-200} \
    python3 -m microserving.cli bench capacity --backend embedded --model llama-1b --device cuda \
    --patterns round-robin disagg --streams ${STREAMS:-128} --input-len 256 --output-len 256 \
    --requests-per-stream 4 --min-requests 24 --rounds 1 --gateway-workers 4 --router-replicas 2 \
    --out $R/cap_$1 > $R/capacity_$1.log 2>&1
  echo "== mps $1 $(date +%T) rc=$?"; grep -E "^\| (round|disagg)" $R/capacity_$1.log
}
echo "== start $(date +%T)"; half off
if ! command -v nvidia-cuda-mps-control > /dev/null; then
  echo "no nvidia-cuda-mps-control on this machine: MPS not tried"; exit 0
fi
nvidia-cuda-mps-control -d > $R/mps_start.log 2>&1; echo "daemon start rc=$?"
half on
echo quit | nvidia-cuda-mps-control; cat $CUDA_MPS_LOG_DIRECTORY/control.log 2>/dev/null | tail -5
echo "== end $(date +%T)"
