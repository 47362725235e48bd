"""The engine alone, in-process: the yardstick of `microserving bench capacity --backend embedded`.

The same workload the stack gets (S closed-loop streams, prompts of `input_len` token ids,
`output_len` tokens each with ignore_eos at temperature 0, a new request as soon as one ends,
so prefills interleave with decode as in serving), run on the engine core's own step loop: no
thread, no pipe, no gRPC, no HTTP. The engine is configured exactly as a shim with the same
flags would configure it (`engine_shim.backends.embedded.backend.engine_config`).

The loop runs in a process of its own, spawned as a shim spawns its engine core, and not in
the benchmark's process (with its event loop, its client and everything they import): in one
H200 run the same engine took 2.08-2.40 ms a step at 64 streams inside the benchmark's process
and 1.80-1.84 inside a shim's core process, where an earlier host had it the other way. The
yardstick now runs where the engine runs in the stack.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from bench.capacity.client import prompt_ids
from bench.capacity.engine_steps import figures
from bench.capacity.nominal import Nominal
from bench.loadgen.stats import percentile
from microserving.gc_tuning import freeze_startup_heap

_STOP_WAIT_S = 30.0


@dataclass(frozen=True)
class AloneResult:
    streams: int
    tok_s: float
    ttft_p50_s: float
    num_tokens: int
    span_s: float
    staggered: bool = False
    engine_steps: dict[str, Any] | None = None  # bench.capacity.engine_steps.figures
    prefix_hit_tokens: int = 0  # prompt tokens the run found in the engine's prefix cache

    def as_nominal(self) -> Nominal:
        return Nominal(tok_s=self.tok_s, decode_tok_s=self.tok_s, ttft_s=self.ttft_p50_s)


class EngineAlone:
    """One engine core for every stream count, in a spawned process of its own (loaded once,
    ended by `close`): `run` there, called from here."""

    def __init__(self, model: str, device: str, max_num_seqs: int, shim_env: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, model, device, max_num_seqs, shim_env),
                                         name="engine-alone", daemon=True)
        self._process.start()
        child.close()
        self._call("started")

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None  # started in __init__
        return pid

    def run(self, streams: int, input_len: int, output_len: int, num_requests: int,
            seed: int, staggered: bool = False) -> AloneResult:
        """_AloneLoop.run, in the engine's process."""
        result: AloneResult = self._call("run", streams, input_len, output_len, num_requests,
                                         seed, staggered)
        return result

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send(None)
        self._process.join(_STOP_WAIT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _call(self, *message: Any) -> Any:
        if message[0] != "started":
            self._conn.send(message)
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine-alone process exited (code {self._process.exitcode})")
        kind, value = self._conn.recv()
        if kind == "failed":
            raise RuntimeError(f"the engine-alone process failed: {value}")
        return value


def _serve(conn: Connection, model: str, device: str, max_num_seqs: int,
           shim_env: dict[str, Any]) -> None:
    """The engine-alone process: load, say so, then run what is asked until told to stop."""
    try:
        loop = _AloneLoop(model, device, max_num_seqs, shim_env)
        conn.send(("ok", None))
        while (message := conn.recv()) is not None:
            _, *args = message
            conn.send(("ok", loop.run(*args)))
    except Exception as error:  # noqa: BLE001 - reported to the benchmark, which stops
        conn.send(("failed", f"{type(error).__name__}: {error}"))


class _AloneLoop:
    """The engine and the closed loop over it, in the engine-alone process."""

    def __init__(self, model: str, device: str, max_num_seqs: int, shim_env: dict[str, Any]) -> None:
        from engine_shim.backends.embedded.backend import engine_config  # torch loads here
        from engine_shim.engine.llm_engine import LLMEngine
        from engine_shim.settings import ShimSettings

        settings = ShimSettings(model=model, device=device, max_num_seqs=max_num_seqs, **shim_env)
        self.engine = LLMEngine(engine_config(settings))
        # Its outputs as plain tuples, as a shim's core process makes them (api.PackedOutput;
        # there the shim unpacks them, in its own process).
        self.engine.packs_outputs = True
        self.engine.warmup()
        freeze_startup_heap()  # as the shims' core processes do, so the comparison stays fair
        self._next_id = 0

    def run(self, streams: int, input_len: int, output_len: int, num_requests: int,
            seed: int, staggered: bool = False) -> AloneResult:
        """`staggered`: the streams start one engine step apart instead of all at once. With
        equal output lengths, streams that start together finish together and come back
        together, so the engine alternates waves of prefill with runs of pure decode (its
        fastest steps); staggered, the arrivals spread over the steps as they do behind any
        network hop, and most steps carry a prefill beside the decodes."""
        from engine_shim.engine.api import SamplingParams

        engine = self.engine
        # Every run starts on an empty prefix cache, as the stack's engines meet each cell's
        # prompts for the first time: the runs of one stream count share their seed (their
        # prompts), and the prompts of the runs before this one, still cached, made its
        # prefills all hits (GPU run 57, H100: 22.9k against 20.0k tok/s at 32 streams and
        # 39.7k against 32.0k at 64 for the run right before a cell against the first).
        engine.drop_prefix_cache()
        hits_before = engine.block_manager.prefix_cache_stats().num_hit_tokens
        rng = random.Random(seed)
        sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        started_s: dict[str, float] = {}  # running request -> its start (-1 after its first token)
        ttfts: list[float] = []
        remaining = num_requests
        num_tokens = 0

        def submit() -> None:
            nonlocal remaining
            remaining -= 1
            request_id = f"alone-{self._next_id}"
            self._next_id += 1
            started_s[request_id] = time.perf_counter()
            engine.start_generate(request_id, prompt_ids(rng, input_len), 0, sampling)

        counters_before = (engine.num_steps, engine.step_time_s, engine.num_sampled_tokens)
        origin_s = time.perf_counter()
        to_start = min(streams, num_requests)
        for _ in range(1 if staggered else to_start):
            submit()
        to_start -= 1 if staggered else to_start
        while started_s:
            if to_start > 0:  # staggered: one more stream each step until all run
                submit()
                to_start -= 1
            events = engine.step()
            now_s = time.perf_counter()
            for event in events:
                if type(event) is not tuple or event[0] not in started_s:
                    continue  # not an output (api.PackedOutput: request id, deltas, usage)
                request_id, deltas, usage = event
                count = sum(len(delta[1]) for delta in deltas)
                num_tokens += count
                request_started_s = started_s[request_id]
                if count and request_started_s >= 0:
                    ttfts.append(now_s - request_started_s)
                    started_s[request_id] = -1.0  # its first token is counted
                if usage is not None:  # finished
                    del started_s[request_id]
                    if remaining > 0:
                        submit()
        span_s = time.perf_counter() - origin_s
        steps = figures(engine.num_steps - counters_before[0], engine.step_time_s - counters_before[1],
                        engine.num_sampled_tokens - counters_before[2], span_s)
        hits = engine.block_manager.prefix_cache_stats().num_hit_tokens - hits_before
        return AloneResult(streams, num_tokens / span_s, percentile(ttfts, 50), num_tokens, span_s,
                           staggered, steps, hits)


