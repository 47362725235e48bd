# The same switch on the NIXL path with the cores in processes of their own (what a GPU runs):
# tiny embedded engines on the CPU VM, disagg at one stream, 40 requests, alternating.
# Usage: bash run.sh OUT_DIR
for i in 1 2; do for mode in on off; do
  arg=""; [ $mode = off ] && arg="--router-arg=--no-send-ahead"
  python -m microserving.cli bench capacity --backend embedded --model tiny --device cpu --patterns disagg \
    --streams 1 --input-len 64 --output-len 16 --requests-per-stream 40 --rounds 1 \
    --shim-arg=--engine-process=on --shim-arg=--kv-transport=nixl $arg --out "$1"/$mode$i
done; done
