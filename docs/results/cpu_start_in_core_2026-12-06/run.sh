# D's start waiting in the engine core (fcab550) against waiting in the shim (63d3a0a, the
# commit before), alternating, two runs each: the NIXL path with each core in a process of
# its own (what a GPU runs), tiny embedded engines on the CPU VM, disagg at one stream, 40
# requests a run. Usage: bash run.sh BASE_TREE HEAD_TREE OUT_DIR
for i in 1 2; do for side in base head; do
  tree=$1; [ $side = head ] && tree=$2
  PYTHONPATH=$tree python -m microserving.cli bench capacity --backend embedded --model tiny --device cpu \
    --patterns disagg --streams 1 --input-len 64 --output-len 16 --requests-per-stream 40 --rounds 1 \
    --shim-arg=--engine-process=on --shim-arg=--kv-transport=nixl --out "$3/$side$i"
done; done
