# Prepared 2026-12-07 (twentieth session): the NIXL send path of this tree (slots a page at a
# time, 3b36ca8) side by side with the tree before it (c80f63f, carried as .ab/s48), taking
# turns (new, old, new): kv_bench's NIXL path idle at 1,024 and 8,176 tokens (P's hold /
# claim / transfer / confirm phases per size), then a 255-token send with D decoding 64
# streams on one Engine.Generate stream (issue 21's RemoteSend under load).
# Usage: OLD=<old tree> bash kv_ab.sh "$OUT"   (run from the new tree's root)
O=$1; mkdir -p "$O"; NEW=$PWD; OLD=${OLD:-$PWD/../s48}
one() {  # tag, tree
  local tag=$1 tree=$2
  echo "== $tag idle $(date +%T)"
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout ${K_T:-100} python3 -m bench.kv_bench --device cuda \
    --model llama-1b --tokens 1024 8176 --num-pages 4096 --paths nixl > $O/kv_$tag.json 2> $O/kv_$tag.log)
  echo "rc=$?"
  echo "== $tag load $(date +%T)"
  (cd $tree && PYTHONPATH=$tree:/tmp/site timeout ${L_T:-100} python3 -m bench.kv_bench --device cuda \
    --model llama-1b --tokens 256 --num-pages 8192 --paths nixl --receiver-load 64 \
    --receiver-load-via stream > $O/load_$tag.json 2> $O/load_$tag.log)
  echo "rc=$?"
}
one new1 $NEW; one old $OLD; one new2 $NEW
python3 - "$O" <<'PY'
import json, sys
for tag in ("new1", "old", "new2"):
    for kind in ("kv", "load"):
        try:
            rows = json.load(open(f"{sys.argv[1]}/{kind}_{tag}.json"))["rows"]
        except Exception as error:
            print(tag, kind, "no rows:", error); continue
        for r in rows:
            print(tag, kind, r["tokens"], "ms", round(r["nixl_transfer_s"] * 1e3, 2), "GB/s",
                  r["nixl_gbps"], r.get("nixl_phases"))
PY
echo "== end $(date +%T)"
