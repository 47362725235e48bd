#!/usr/bin/env bash
# Everything issue 9 measures on one CUDA GPU, in one go (about 8 minutes on an H200):
# the gpu-marked tests, the engine-vs-transformers benchmark, the KV-transfer benchmark on the
# GPU, and the whole stack (`microserving up --device cuda`) under `microserving bench` for
# round-robin and disagg with both engines on the one GPU. Results go to $OUT (default
# gpu_results/). Set GPU_STEPS to a subset, e.g. GPU_STEPS="tests bench"; `capacity` (the
# engine alone against the whole stack, issue 16), `prefill-ab` (the same with the prefill
# kernel off, then on), `ab` (the same over the values of one setting) and `capacity-cpu2`
# (the CPU capacity benchmark on two cores) run only when named.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_results}"
steps="${GPU_STEPS:-tests bench kv stack}"
python="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/machine.txt"

for step in $steps; do
  echo "== $step at $(date +%T)" | tee -a "$out/steps.txt"
  case "$step" in
    tests)
      timeout 240 "$python" -m pytest -q tests/gpu -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25 ;;
    bench)
      timeout "${GPU_BENCH_TIMEOUT_S:-360}" "$python" -m bench.gpu_bench ${GPU_BENCH_ARGS:-} --out "$out" 2>&1 \
        | grep -v Warning | tee "$out/gpu_bench.log" | grep -v '^ \|^{\|^}' ;;
    kv)
      # nixl, shm and gRPC side by side (nixl left out, with a note, where NIXL does not load)
      timeout "${GPU_KV_TIMEOUT_S:-300}" "$python" -m bench.kv_bench --device cuda --model llama-1b --tokens 1024 8176 \
        --num-pages 4096 > "$out/kv_bench.json" 2> "$out/kv_bench.log"; tail -3 "$out/kv_bench.log" ;;
    stack)
      export MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 MICROSERVING_SHIM_MAX_NUM_SEQS=64
      timeout 420 "$python" -m microserving.cli bench patterns --model llama-1b \
        --patterns ${GPU_PATTERNS:-round-robin disagg} --rates ${GPU_RATES:-4 8 16} \
        --duration-s ${GPU_DURATION_S:-12} --min-prompts 16 --input-len 1000 --output-len 100 \
        --up-arg=--device=cuda --out "$out/stack" 2>&1 | tail -30 | tee "$out/stack.log" ;;
    capacity)
      # Issue 16: the engine alone in-process against the whole stack (gateway workers, router
      # replicas, shims) on the same closed-loop workload, round-robin (one engine) and disagg
      # (1P:1D on the one GPU), with each process's CPU; each round's cells against the engine
      # alone run right before them (the H200's speed drifted by up to 7% between rounds).
      MICROSERVING_SHIM_KV_CACHE_MEMORY_MB="${GPU_KV_MB:-16384}" timeout "${GPU_CAPACITY_TIMEOUT_S:-540}" \
        "$python" -m microserving.cli bench capacity --backend embedded --model llama-1b \
        --device cuda --streams ${GPU_STREAMS:-1 32 64 128} --input-len 256 --output-len 256 \
        --requests-per-stream "${GPU_REQUESTS_PER_STREAM:-6}" --min-requests "${GPU_MIN_REQUESTS:-24}" \
        --rounds "${GPU_ROUNDS:-3}" \
        --gateway-workers "${GPU_GATEWAY_WORKERS:-4}" --router-replicas "${GPU_ROUTER_REPLICAS:-2}" \
        --alone-each-round ${GPU_CAPACITY_ARGS:-} --out "$out/capacity" 2>&1 | tee "$out/capacity.log" | tail -16 ;;
    prefill-ab)
      # Issue 16, side by side in one run: the capacity benchmark with the per-sequence prefill
      # path (MICROSERVING_SHIM_PAGED_PREFILL=false), then the one-launch paged kernel (the
      # default), given to every shim and to the in-process engine alike.
      for value in false true; do
        env "MICROSERVING_SHIM_PAGED_PREFILL=$value" MICROSERVING_SHIM_KV_CACHE_MEMORY_MB="${GPU_KV_MB:-16384}" \
          timeout "${AB_TIMEOUT_S:-300}" "$python" -m microserving.cli bench capacity --backend embedded \
          --model llama-1b --device cuda --patterns ${AB_PATTERNS:-round-robin} \
          --streams ${AB_STREAMS:-32 64 128} --input-len 256 --output-len 256 \
          --requests-per-stream "${AB_REQUESTS_PER_STREAM:-4}" --min-requests "${AB_MIN_REQUESTS:-24}" \
          --rounds "${AB_ROUNDS:-2}" \
          --gateway-workers 4 --router-replicas 2 ${AB_ARGS:-} --out "$out/${step}_$value" 2>&1 \
          | tee "$out/${step}_$value.log" | tail -6
      done ;;
    ab)
      # Issue 16, side by side in one run: AB_ENV over AB_VALUES in every stack process (not
      # the engine alone, measured once), e.g. AB_ENV=MICROSERVING_ROUTER_SEND_AHEAD
      # AB_VALUES="false true". Each round runs each value on a stack started with it, in the
      # other order each round (bench capacity --ab-env), so that a drift of the machine over
      # the run falls on both alike.
      MICROSERVING_SHIM_KV_CACHE_MEMORY_MB="${GPU_KV_MB:-16384}" \
        timeout "${AB_TIMEOUT_S:-540}" "$python" -m microserving.cli bench capacity --backend embedded \
        --model llama-1b --device cuda --patterns ${AB_PATTERNS:-round-robin} \
        --streams ${AB_STREAMS:-32 64 128} --input-len 256 --output-len 256 \
        --requests-per-stream "${AB_REQUESTS_PER_STREAM:-4}" --min-requests "${AB_MIN_REQUESTS:-24}" \
        --rounds "${AB_ROUNDS:-2}" --ab-env "${AB_ENV:?AB_ENV names the setting}" \
        --ab-values ${AB_VALUES:?AB_VALUES lists its values} \
        --gateway-workers 4 --router-replicas 2 --alone-each-round ${AB_ARGS:-} --out "$out/ab" 2>&1 \
        | tee "$out/ab.log" | tail -8 ;;
    capacity-cpu2)
      # The CPU capacity benchmark (synthetic engines) on two of this host's cores, the size
      # of the development machine, with nothing else running.
      timeout "${CPU2_TIMEOUT_S:-420}" taskset -c 0,1 "$python" -m microserving.cli bench capacity \
        --streams ${CPU2_STREAMS:-1 32 64 128} --rounds "${CPU2_ROUNDS:-3}" \
        --duration-s "${CPU2_DURATION_S:-6}" --warmup-s 2 ${CPU2_ARGS:-} \
        --out "$out/capacity_cpu2" 2>&1 | tee "$out/capacity_cpu2.log" | tail -12 ;;
  esac
done
echo "== done at $(date +%T)" | tee -a "$out/steps.txt"
