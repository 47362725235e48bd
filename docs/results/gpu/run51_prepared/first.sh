# Run 51's first call (2026-12-07, twenty-second session), picked by the card it lands on.
# An H200 (none lent since run 22): issue 16's table on the current tree, round-robin then
# disagg, three rounds each, each part under its own limit (what finishes is kept).
# An H100: the same-GPU copy of an 8k send four ways (copy_bench.py), then kv_bench's NIXL
# path at 1,024 and 8,176 tokens on this tree (its client now on the stack's gRPC I/O stack,
# and each row with P's whole send and the call around it: send_ms, outside_ms).
# Usage: bash first.sh "$OUT"
here=$(dirname "$0"); O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PART=rr T=${T_RR:-270} bash docs/results/gpu/run50_prepared/table3.sh "$O/rr"
  PART=disagg T=${T_DG:-270} bash docs/results/gpu/run50_prepared/table3.sh "$O/disagg"
else
  echo "== copy $(date +%T)"; timeout 120 python3 $here/copy_bench.py 2>&1 | tee $O/copy.txt
  echo "== kv $(date +%T)"
  timeout 150 python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 1024 8176 \
    --num-pages 4096 --paths nixl > $O/kv.json 2> $O/kv.log; echo "rc=$?"
  python3 -c "
import json
for r in json.load(open('$O/kv.json'))['rows']:
    print(r['tokens'], round(r['nixl_transfer_s'] * 1e3, 2), 'ms', r['nixl_gbps'], 'GB/s', r.get('nixl_phases'))"
fi
echo "== end $(date +%T)"
