# Run 60 as it ran (2026-12-07, twenty-fourth session, one H100): four calls on one warm
# machine, from main's root, with the carried wheels (.gpuwhl, .gpunixl). Outputs: calls12/
# (the first two rounds of each pattern), call3/ (the third round of both).
source .gpuwhl/prep.sh >/dev/null 2>&1; export PYTHONUNBUFFERED=1
# call 1 and call 2
ROUNDS=2 PART=rr T=400 bash docs/results/gpu/run50_prepared/table3.sh "$OUT/rr"
ROUNDS=2 PART=disagg T=420 bash docs/results/gpu/run50_prepared/table3.sh "$OUT/disagg"
# call 3 (its round-robin log was left out of what came back: too many files)
ROUNDS=1 PART=rr T=200 bash docs/results/gpu/run50_prepared/table3.sh "$OUT/rr"
ROUNDS=1 PART=disagg T=230 bash docs/results/gpu/run50_prepared/table3.sh "$OUT/disagg"
