# Prepared 2026-12-07 (twenty-fourth session): an experiment, not on main. The engine core
# polls its NIXL side after a step and only then sends the step's events to the shim; when
# that poll posts the writes of sends whose KV the step computed (and spins up to 0.2 ms plus
# their bytes at 200 GB/s for them to end), a first token that P sampled in the same step
# waits for it. emit_first.patch sends the step's events before such a poll (Side.posts_writes:
# parked or fresh writes), gated for this A/B by MICROSERVING_CORE_EMIT_FIRST (0: main's order).
# On the CPU (tiny, the core in its own process, NIXL in DRAM, one stream, five rounds taking
# turns) the first token did not move beyond the VM's spread (+6.59 ms median with 0, +6.57
# with 1; results/cpu_emit_first_2026-12-07/): the saving is bounded by the post and the spin
# window, a few tenths of a ms a step. Here: the patched tree, disagg at 1 and 32 streams,
# three rounds, both orders in every round. Land it only if the first token moves.
# Usage: bash first.sh "$OUT"   (from main's root)
O=$1; mkdir -p "$O"; OLD=$PWD; NEW=/tmp/ef
rm -rf $NEW && mkdir -p $NEW && cp -r engine_shim microserving router gateway colocated bench \
  pyproject.toml $NEW/ && (cd $NEW && patch -p1 -s < $OLD/docs/results/gpu/run62_prepared/emit_first.patch) || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $O/card.txt
export MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384
cd $NEW && PYTHONPATH=$NEW:/tmp/site timeout ${T:-400} python3 -m microserving.cli bench capacity \
  --backend embedded --model llama-1b --device cuda --input-len 256 --output-len 256 \
  --alone-each-round --gateway-workers 4 --router-replicas 2 --patterns disagg --streams 1 32 \
  --rounds ${ROUNDS:-3} --requests-per-stream 6 --min-requests 30 \
  --ab-env MICROSERVING_CORE_EMIT_FIRST --ab-values 0 1 --out /tmp/r62 > $O/ab.log 2>&1
echo "rc=$?"; grep -E "^  disagg|^\| " $O/ab.log | cut -c1-220
cp /tmp/r62/cells.jsonl /tmp/r62/capacity.json $O/ 2>/dev/null
echo "== end $(date +%T)"
