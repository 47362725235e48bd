"""P's RemoteSend log lines (shim at INFO) summarized: percentiles of each phase, ms."""

import re
import statistics
import sys
from pathlib import Path

LINE = re.compile(r"RemoteSend \S+: (\d+) tokens.* in ([\d.]+) ms \(hold ([\d.]+) \(accepted at ([\d.]+)\), "
                  r"claim ([\d.]+), transfer ([\d.]+), confirm ([\d.]+) ms\)")
NAMES = ("total", "hold", "accepted", "claim", "transfer", "confirm")


def main(path: str) -> None:
    rows = [tuple(float(x) for x in m.groups()[1:]) for m in map(LINE.search, Path(path).read_text().splitlines()) if m]
    print(f"{path}: {len(rows)} sends")
    if not rows:
        return
    for i, name in enumerate(NAMES):
        values = sorted(r[i] for r in rows)
        q = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        print(f"  {name:9s} p10 {q[0]:6.1f}  p50 {statistics.median(values):6.1f}  p90 {q[-1]:6.1f}  "
              f"mean {statistics.fmean(values):6.1f}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        main(name)
