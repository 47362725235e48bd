"""Per-request timeline at one stream: for each client.post, the first time each (role, event)
occurs after it and before client.first; medians over requests, ordered by median."""

import collections
import glob
import os
import re
import statistics as st
import sys
from pathlib import Path

d = sys.argv[1] if len(sys.argv) > 1 else "/tmp/lat/st"
only = sys.argv[2] if len(sys.argv) > 2 else None  # keep requests that touched this role
roles = {}
ppids = {}
events = []
for f in glob.glob(f"{d}/*.txt"):
    pid = os.path.basename(f)[:-4]
    lines = Path(f).read_text().splitlines()
    head = next((line for line in lines if line.startswith("#pid")), "")
    m = re.match(r"#pid (\d+) ppid (\d+) argv (.*)", head)
    argv = m.group(3) if m else ""
    ppids[pid] = m.group(2) if m else ""
    if " gateway" in argv or "serve" in argv.split()[:3]:
        r = "gw"
    elif " router" in argv:
        r = "router"
    elif " shim" in argv:
        mm = re.search(r"--role[ =](\w+)", argv)
        r = "shim-" + (mm.group(1) if mm else "?")
    elif "spawn" in argv or "multiprocessing" in argv:
        r = "core"
    else:
        r = "client"
    roles[pid] = r
    for line in lines:
        if line.startswith("#"):
            continue
        n, t = line.split()
        events.append((float(t), n, pid))
for pid, r in list(roles.items()):
    if r == "core":  # a spawned child: a gateway worker, or a shim's engine core
        parent = roles.get(ppids[pid], "?")
        roles[pid] = parent if parent in ("gw", "router") else "core(" + parent + ")"
events.sort()
res = collections.defaultdict(list)
starts = [i for i, e in enumerate(events) if e[1] == "client.post"]
n = 0
for si in starts[3:]:
    t0 = events[si][0]
    seen = {}
    for t, name, pid in events[si + 1 :]:
        if name == "client.post":
            break
        key = f"{roles[pid]}:{name}"
        if key not in seen:
            seen[key] = t
        if name == "client.first":
            break
    if "client:client.first" not in seen:
        continue
    if only and not any(k.startswith(only + ":") for k in seen):
        continue
    n += 1
    for k, t in seen.items():
        res[k].append((t - t0) * 1e3)
print(f"{n} requests")
rows = sorted((st.median(v), k, len(v)) for k, v in res.items() if len(v) >= n * 0.6)
prev = 0
for m, k, c in rows:
    print(f"{k:45s} {m:8.3f}  +{m - prev:6.3f}  n={c}")
    prev = m
    if k == "client:client.first":
        break
