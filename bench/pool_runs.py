"""How many runs of consecutive slots a decode engine's PrepRecv reservations get, on a fresh
KV pool and once the pool has recycled its pages: the real engine (`LLMEngine`, the tiny
model on the CPU) driven as a decode engine under a closed loop (PrepRecv, the KV marked
written, StartGenerate, decode to the end, the next request), its pool small enough to
recycle within the run. A NIXL write moves one piece per run and KV plane, so the runs
multiply a RemoteSend's descriptors (block_manager.BlockManager.allocate).

    PYTHONPATH=. python -m bench.pool_runs --streams 8 --requests 240 --num-pages 600
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_shim.engine.api import GenerateOutput, SamplingParams
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.llm_engine import LLMEngine


def reservation_runs(streams: int, num_requests: int, num_pages: int, prompt_len: int,
                     output_len: int, seed: int = 0) -> tuple[list[int], int]:
    """(runs of each reservation in order, the index of the first made after the pool's
    never-used pages ran out)."""
    engine = LLMEngine(EngineConfig(num_pages=num_pages, page_size=16))
    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    runs: list[int] = []
    recycled_from = -1
    started = 0

    def start() -> None:
        nonlocal started, recycled_from
        request_id = f"r{started}"
        started += 1
        ids = [rng.randrange(256) for _ in range(prompt_len)]
        pool = engine.block_manager
        if recycled_from < 0 and pool.num_free_pages == pool.prefix_cache_stats().num_evictable_pages:
            recycled_from = len(runs)  # no unused page left: what it gets is evicted
        reserved = engine.prep_recv(request_id, ids, -1)
        runs.append(reserved.kv_segments[0])
        engine.begin_kv_write(request_id, time.monotonic() + 60)
        engine.finish_kv_write(request_id)
        engine.start_generate(request_id, ids, reserved.end, sampling)

    for _ in range(streams):
        start()
    while started < num_requests:
        for event in engine.step():
            # Outputs come as GenerateOutput (the engine packs none: packs_outputs is off).
            if isinstance(event, GenerateOutput) and event.is_finished and started < num_requests:
                start()
    return runs, recycled_from


def figures(runs: list[int]) -> dict[str, float | int]:
    """Reservations and their runs: median, mean, p90 and max."""
    if not runs:
        return {"reservations": 0}
    ordered = sorted(runs)
    return {"reservations": len(runs), "median_runs": statistics.median(runs),
            "mean_runs": round(statistics.fmean(runs), 2),
            "p90_runs": ordered[int(0.9 * (len(ordered) - 1))], "max_runs": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--num-pages", type=int, default=600)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    runs, recycled_from = reservation_runs(args.streams, args.requests, args.num_pages,
                                           args.prompt_len, args.output_len)
    fresh = runs[:recycled_from] if recycled_from >= 0 else runs
    recycled = runs[recycled_from:] if recycled_from >= 0 else []
    report = {
        "streams": args.streams, "requests": len(runs), "num_pages": args.num_pages,
        "pages_a_reservation": -(-args.prompt_len // 16),
        "fresh": figures(fresh),
        "recycled": figures(recycled),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
