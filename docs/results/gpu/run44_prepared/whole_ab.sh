# Prepared 2026-12-06 (seventeenth session). Run 42 found D's steps at 128 streams slower than
# the engine alone's (2.81 against 2.48 ms in a step, 3.37 against 2.58 a loop turn): each
# continuation computed the prompt's last position with its first token, two positions, so
# every step that took one in was a prefill step (eager, no CUDA graph) and broke D's chain
# of decode steps. The tree under test: D receives the whole prompt (PrepRecv.whole_prompt),
# its continuation is one plain decode row, and it joins D's chained step (_chain_joiners).
# Side by side on one machine: this tree ($NEW) and the one before it ($OLD, ae762b4), disagg
# at 32, 64 and 128 streams, the engine alone before every cell, taking turns (new, old,
# new); round-robin once on the new tree. Usage: bash whole_ab.sh "$OUT" (from the new tree).
O=$1; mkdir -p "$O"; NEW=$PWD; OLD=${OLD:-$PWD/../s42}
export MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
common="--backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256
  --alone-each-round --gateway-workers 4 --router-replicas 2 --streams 32 64 128 --rounds 1
  --requests-per-stream 6 --min-requests 30"
run() {  # tree, label, patterns...
  local tree=$1 label=$2; shift 2
  echo "== $label $(date +%T)"
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout ${T:-170} python3 -m microserving.cli bench capacity \
    $common --patterns "$@" --out /tmp/$label > $O/$label.log 2>&1; echo "rc=$?")
  cp /tmp/$label/cells.jsonl $O/$label.cells.jsonl 2>/dev/null
  grep -h -E "^\| |round [0-9]:" $O/$label.log | cut -c1-300
}
echo "== gpu tests of chained steps $(date +%T)"
PYTHONPATH=$NEW:/tmp/site timeout ${T_TESTS:-150} python3 -m pytest -q tests/gpu -k chain \
  -p no:cacheprovider > $O/gpu_tests.log 2>&1; tail -3 $O/gpu_tests.log
run $NEW new1 disagg
run $OLD old disagg
T=230 run $NEW new2 disagg round-robin
echo "== end $(date +%T)"
