"""Each stack cell of `bench capacity` logs against the engine alone's first (cold) closed-loop
run of its stream count and round, beside the yardstick it was measured against: before the
fix of 2026-12-07, the yardstick run found its prompts in the engine's prefix cache whenever the
runs of the same seed before it had not been evicted meanwhile."""

import re
import sys
from pathlib import Path

ALONE = re.compile(r"engine alone streams +(\d+) round (\d+): ([\d,]+) tok/s")
YARD = re.compile(r"engine alone streams +(\d+) round (\d+) \(this round's yardstick\): ([\d,]+) tok/s")
CELL = re.compile(r"^  (\S+) +streams +(\d+) round (\d+)(?: \[[^\]]*\])?: ([\d,]+) tok/s \(ratio ([\d.]+)\)")


def tok_s(text: str) -> float:
    return float(text.replace(",", ""))


def main(path: Path) -> None:
    cold: dict[tuple[int, int], float] = {}
    yardstick = 0.0
    for line in path.read_text().splitlines():
        if m := YARD.search(line):
            yardstick = tok_s(m[3])
        elif m := ALONE.search(line):
            cold.setdefault((int(m[1]), int(m[2])), tok_s(m[3]))
        elif (m := CELL.search(line)) and m[1] != "engine":
            key = (int(m[2]), int(m[3]))
            stack = tok_s(m[4])
            if key in cold:
                print(f"{path}: {m[1]} {key[0]} round {key[1]}: {stack:,.0f} tok/s, "
                      f"ratio {m[5]} against the yardstick {yardstick:,.0f}; "
                      f"{stack / cold[key]:.2f} against the cold {cold[key]:,.0f}")


if __name__ == "__main__":
    for name in sys.argv[1:]:
        main(Path(name))
