# Run 51's fourth call: an 8,176-token NIXL send made as the router makes it (a message on P's
# Engine.Generate stream, kv_bench --send-via stream) and as a unary call, one after the other.
O=$1; mkdir -p "$O"
export PYTHONPATH=$PWD:/tmp/site
for via in stream unary; do
  echo "== $via $(date +%T)"
  timeout 75 python3 -m bench.kv_bench --device cuda --model llama-1b --tokens 8176 --num-pages 4096 \
    --paths nixl --send-via $via > $O/$via.json 2> $O/$via.log; echo "rc=$?"
  python3 -c "
import json
for r in json.load(open('$O/$via.json'))['rows']:
    print(r['send_via'], r['tokens'], round(r['nixl_transfer_s'] * 1e3, 2), 'ms', r['nixl_gbps'], 'GB/s', r.get('nixl_phases'))"
done
echo "== end $(date +%T)"
