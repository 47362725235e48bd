"""One line per cell of the capacity.json files in a folder (`python summarize.py FOLDER`):
ratio, tokens per SSE chunk, first token over the schedule, and CPU ms per 1,000 tokens of
each process (`total`: the control plane, gateway + router + shims' serving)."""

import glob
import json
import sys
from pathlib import Path

for path in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    for row in json.loads(Path(path).read_text())["rows"]:
        cpu = row["cpu_ms_per_1k_tokens"]
        print(f"{Path(path).stem:8s} {row['pattern']:12s} streams={row['streams']:3d} "
              f"ratio={row['ratio']:.3f} tokens/chunk={row['tokens_per_chunk']:.2f} "
              f"ttft+={row['ttft_added_p50_ms']:6.1f} ms "
              + " ".join(f"{k}={v:.1f}" for k, v in cpu.items())
              + f" engine-threads={sum(row['engine_thread_ms_per_1k_tokens'].values()):.1f}"
              f" client={row['client_cpu_ms_per_1k_tokens']:.1f} busy={row['machine_busy_cores']:.2f}")
