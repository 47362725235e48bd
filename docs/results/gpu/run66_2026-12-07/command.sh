# Run 66 as it ran (2026-12-07, twenty-fifth session, one H100, no GPU used): the MLC relay,
# round-robin at 128 streams, one round, py-spy on the relay side's processes for 5 s.
# Summaries: the top frames of each profile (leaf and inclusive shares of samples).
source .gpuwhl/prep.sh >/dev/null 2>&1; export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 -m microserving.cli bench mlc-relay --patterns round-robin --streams 128 \
  --rounds 1 --duration-s 6 --warmup-s 2 --profile-s 5 --out /tmp/r66 > /tmp/r66.log 2>&1
