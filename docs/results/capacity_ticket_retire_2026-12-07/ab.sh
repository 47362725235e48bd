# A/B: old tree (e45723c) vs new (main), taking turns; args: streams output-len rounds
S=$1; L=$2; R=$3; OUTD=/tmp/ab_$S_$L; mkdir -p /tmp/abres
for r in $(seq 1 $R); do
  for side in old new; do
    if [ $side = old ]; then T=/tmp/wt_old; else T=/work/main; fi
    rm -rf /tmp/abrun; cd $T
    PYTHONPATH=$T PATH=/work/main/.venv/bin:$PATH timeout 300 python -m microserving.cli bench capacity --patterns disagg --streams $S --output-len $L --rounds 1 --duration-s 10 --warmup-s 3 --out /tmp/abrun > /tmp/abrun.log 2>&1
    echo "$side r$r $(grep -E '^\| disagg' /tmp/abrun.log)"
  done
done
