# Prepared 2026-12-07 (twenty-first session): a prompt's ids as one array from the shim to the
# engine core (checked by dtype and range, one buffer through the pipe) against the tree before
# it (8895f7f, carried as .ab/s49 with this tree's bench/kv_bench.py, so the client is the
# same), taking turns (new, old, new): kv_bench's NIXL path idle at 1,024 and 8,176 tokens,
# then a 256-token send with D decoding 64 streams on one Engine.Generate stream; then 8,176
# tokens alone, old / new twice more; then nixl beside shm and gRPC once on the new tree.
# Usage: OLD=<old tree> bash kv_ab.sh "$OUT" (from the new tree's root)
O=$1; mkdir -p "$O"; NEW=$PWD; OLD=${OLD:-$PWD/.ab/s49}; S=/tmp/kvab; mkdir -p $S
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
kv() {  # tag, tree, then kv_bench arguments; prints the rows at once
  local tag=$1 tree=$2; shift 2
  echo "== $tag $(date +%T)"
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout ${K_T:-120} python3 -m bench.kv_bench --device cuda \
    --model llama-1b "$@" > $S/$tag.json 2> $S/$tag.log); echo "rc=$?"
  python3 - $S/$tag.json <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as error:
    print("no rows:", error); sys.exit()
for r in rows:
    print({k: v for k, v in r.items() if k.endswith(("_s", "gbps", "phases")) or k == "tokens"})
PY
}
for round in new1:$NEW old1:$OLD new2:$NEW; do
  tag=${round%%:*}; tree=${round#*:}
  kv idle_$tag $tree --tokens 1024 8176 --num-pages 4096 --paths nixl
  kv load_$tag $tree --tokens 256 --num-pages 8192 --paths nixl --receiver-load 64 --receiver-load-via stream
done
# SHORT=1 (little device time left): the three turns above only
[ -n "${SHORT:-}" ] && { echo "== end (short) $(date +%T)"; exit 0; }
for round in old2:$OLD new3:$NEW old3:$OLD new4:$NEW; do
  tag=${round%%:*}; tree=${round#*:}
  kv only8k_$tag $tree --tokens 8176 --num-pages 4096 --paths nixl
done
kv paths_new $NEW --tokens 1024 8176 --num-pages 4096
python3 -c "
import json, pathlib, sys
src = pathlib.Path('$S'); out = {}
for p in sorted(src.glob('*.json')):
    try: out[p.stem] = json.loads(p.read_text())['rows']
    except Exception as e: out[p.stem] = repr(e)
pathlib.Path('$O/kv_ab.json').write_text(json.dumps(out, indent=1))"
tail -c 3000 $S/paths_new.log > $O/paths_new.log.txt; tail -c 2000 $S/load_new1.log > $O/load_new1.log.txt
echo "== end $(date +%T)"
