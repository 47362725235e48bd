# Disagg at 128 streams on the CPU VM, tiny embedded engines with their cores in processes of
# their own (so P's NIXL agent sits beside its core and claims as each send begins), every
# router and shim at INFO; four rounds. Run once per tree (a worktree per commit):
#   bash run.sh OUT_DIR
# then count the router's failed RemoteSends by reason and P's parked writes given up:
#   grep -h "remote_send on .* failed: [A-Z_]* ." OUT_DIR/logs/*router*.log | sed -E 's/.*failed: //' | sort | uniq -c
#   grep -c "gave up a KV write" OUT_DIR/logs/*shim-prefill*.log
python -m microserving.cli bench capacity --backend embedded --model tiny --device cpu \
  --patterns disagg --streams 128 --input-len 64 --output-len 16 --requests-per-stream 3 --rounds 4 \
  --gateway-workers 1 --router-replicas 1 --shim-arg=--engine-process=on --shim-arg=--log-level=INFO \
  --router-arg=--log-level=INFO --out "$1"
