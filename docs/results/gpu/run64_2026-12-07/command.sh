# Run 64 as it ran (2026-12-07, twenty-fifth session): an H100 came, so first.sh ran the MLC
# relay on the host's 16 cores (run63_prepared/mlc_relay.sh, two rounds; no GPU used).
source .gpuwhl/prep.sh >/dev/null 2>&1; PART=rr ROUNDS=2 T=430 bash docs/results/gpu/run64_prepared/first.sh "$OUT/c1"
