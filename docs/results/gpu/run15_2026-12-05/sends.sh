# Prepared for the next device loan (not run): disagg 1P:1D at 1 and 128 streams, one round,
# P logging each NIXL send's phases (hold, the engine accepting it, claim, transfer, D's
# confirmation) to split run 15's 157 ms RemoteSend mean at 128 streams between P's queue, the
# GPU shared by two processes (P's core waited in Event.synchronize inside its prefill graph's
# launch), the write and D's notification. Usage on the device: bash sends.sh "$OUT"
O=$1; R=/tmp/sends; rm -rf $R; mkdir -p $R "$O"
finish() { cd $R && find . -name "*.log" -path "*logs*" -size +4M -delete; tar czf $O/res.tgz . ; }
trap finish EXIT
PYTHONPATH=$PWD:/tmp/site MICROSERVING_SHIM_KV_CACHE_MEMORY_MB=16384 timeout ${SENDS_T:-300} \
  python3 -m microserving.cli bench capacity --backend embedded --model llama-1b --device cuda \
  --patterns disagg --streams 1 128 --input-len 256 --output-len 256 --requests-per-stream 4 \
  --min-requests 24 --rounds 1 --gateway-workers 4 --router-replicas 2 \
  --shim-arg=--log-level=INFO --out $R/cap > $R/capacity.log 2>&1
grep -E "^\| disagg" $R/capacity.log
grep -h "RemoteSend .*hold" $R/cap/logs/*prefill*.log | tail -3
