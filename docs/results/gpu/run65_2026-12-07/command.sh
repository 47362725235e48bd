# Run 65 as it ran (2026-12-07, twenty-fifth session, one H100): run62_prepared's A/B
# (emit_first.patch applied on a copy, MICROSERVING_CORE_EMIT_FIRST 0 = main's order, 1 = the
# patch's), disagg at 1 and 32 streams, three rounds, both orders every round.
source .gpuwhl/prep.sh >/dev/null 2>&1; export PYTHONUNBUFFERED=1
timeout 450 bash docs/results/gpu/run62_prepared/first.sh "$OUT/r62" > $OUT/r62.log 2>&1
