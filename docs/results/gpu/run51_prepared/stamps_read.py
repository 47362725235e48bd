"""Reads run 51's stamps: per warm NIXL send, the client's call to P's servicer entry, the
servicer, and its exit to the client's return (ms, medians per size)."""
import re
import statistics
import sys

with open(sys.argv[1]) as log:
    client = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"CSTAMP (\S+) (\S+) (\S+)", log.read())}
with open(sys.argv[2]) as log:
    server = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"STAMP (\S+) in (\S+) out (\S+)", log.read())}
by_size = {}
for rid, (c0, c1) in client.items():
    if not rid.startswith("warm-nixl-") or rid not in server:
        continue
    s0, s1 = server[rid]
    by_size.setdefault(rid.split("-")[2], []).append(((s0 - c0) * 1e3, (s1 - s0) * 1e3, (c1 - s1) * 1e3, (c1 - c0) * 1e3))
for size, rows in by_size.items():
    med = [round(statistics.median(r[i] for r in rows), 3) for i in range(4)]
    print(f"{size} tokens, {len(rows)} sends: to the servicer {med[0]} ms, servicer {med[1]}, back {med[2]}, whole {med[3]}")
