"""`microserving shim`: flags -> ShimSettings (flags override MICROSERVING_SHIM_* variables)
-> ShimServer; SIGTERM / SIGINT drain in-flight calls within --drain-grace-s, then stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from pydantic import ValidationError

from engine_shim.malloc_tuning import tune_for_large_buffers
from engine_shim.settings import ShimSettings
from microserving import cpu_latency, tracing
from microserving.event_loop import loop_runner
from microserving.gc_tuning import freeze_startup_heap
from microserving.tokenizer import MODEL_HELP
from microserving.tracing import configure_logging

logger = logging.getLogger("engine_shim")

# flag -> settings field; flags left out fall back to the environment, then the defaults.
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--backend", str, "embedded | mlc | synthetic (BENCHMARK ONLY: a model-free engine that "
     "emits tokens on a GPU step-time schedule; never a test of the engine)"),
    ("--model", str, MODEL_HELP),
    ("--host", str, "interface to bind (default 127.0.0.1)"),
    ("--port", int, "gRPC port; 0 picks a free one (the bound port is printed)"),
    ("--metrics-port", int, "HTTP port of Prometheus /metrics; 0 picks a free one (default: none)"),
    ("--advertise-address", str, "host:port peers push KV to (default host:bound port)"),
    ("--device", str, "cpu | cuda | cuda:N (embedded)"),
    ("--cpu-threads", int, "torch threads of the embedded engine on the CPU (default 0: one per "
     "core); engines sharing a host's cores each need their share"),
    ("--role", str, "prefill | decode | both"),
    ("--dtype", str, "auto | float32 | bfloat16 | float16 (embedded; auto: bf16 on CUDA)"),
    ("--page-size", int, "tokens per KV page (embedded)"),
    ("--num-pages", int, "KV pages in the pool (embedded)"),
    ("--kv-cache-memory-mb", int, "KV pool budget when --num-pages is not given"),
    ("--max-num-seqs", int, "sequences one engine step runs at most (embedded)"),
    ("--prefill-chunk-size", int, "prompt tokens one engine step computes (embedded)"),
    ("--enable-prefix-cache", str, "true | false: reuse KV of shared prompt prefixes (embedded)"),
    ("--cuda-graphs", str, "true | false: replay CUDA graphs for decode steps (embedded, CUDA)"),
    ("--mixed-cuda-graphs", str, "true | false: steps that prefill replay CUDA graphs too, one "
     "a token-count bucket (embedded, CUDA, with --cuda-graphs)"),
    ("--paged-prefill", str, "true | false: a step's prompts in one Triton kernel launch a "
     "layer (embedded, CUDA; false: one attention call per prompt)"),
    ("--prefill-hold-ms", float, "while requests decode, a new prompt waits up to this long for "
     "others to share its prefill step (embedded; default 0)"),
    ("--engine-process", str, "auto | on | off: the engine core in a process of its own (auto: "
     "on CUDA), so its host work and the shim's serving each get a core"),
    ("--reservation-ttl-s", float, "seconds a PrepRecv reservation waits for its StartGenerate"),
    ("--mlc-url", str, "base URL of a running MLC-LLM server (mlc backend)"),
    ("--mlc-model-lib", str, "model lib: start `mlc_llm serve` when no --mlc-url is given"),
    ("--mlc-timeout-s", float, "upper bound of one MLC HTTP call"),
    ("--drain-grace-s", float, "seconds in-flight calls get on SIGTERM / SIGINT"),
    ("--kv-push-chunk-bytes", int, "largest KV payload of one PushKV message"),
    ("--kv-transport", str, "auto | nixl | shm | grpc: how KV moves to peer shims"),
    ("--kv-write-timeout-s", float, "bound on one NIXL KV write"),
    ("--kv-nixl-local-copy", str, "true | false: NIXL writes between engines on one GPU copy into "
     "the receiver's pool mapped by CUDA IPC, NIXL carrying the notification (default true)"),
    ("--start-after-kv-in-engine", str, "true | false: a start that waits for its KV waits in "
     "the engine core (default) or in the shim (embedded)"),
    ("--kv-shm", str, "true | false: KV through shared memory between shims of one host"),
    ("--kv-shm-max-mb", int, "shared-memory KV stages a receiving shim keeps at most"),
    ("--kv-peers", str, "comma-separated host:port this shim may push KV to (besides routers' engines)"),
    ("--kv-peer-ttl-s", float, "seconds an engine a router reported stays a KV peer"),
    ("--kv-push-timeout-s", float, "deadline of one KV push to a peer"),
    ("--kv-push-stall-timeout-s", float, "a gRPC KV push whose receiver takes nothing this long "
     "fails UNAVAILABLE (default 10)"),
    ("--kv-push-stream", str, "true | false: pushes through the receiver's shared-memory stage "
     "go on one long-lived stream per peer (default true) or a call each"),
    ("--max-prompt-tokens", int, "largest prompt (token ids) one call may carry"),
    ("--stream-interval-ms", float, "Engine.Generate: least ms between messages after a "
     "request's first token (several steps per message; default 0: one per step)"),
    ("--stream-updates-per-s", float, "Engine.Generate: most request updates a second on "
     "one stream (messages N running / this apart; default 8000; 0: unbounded)"),
    ("--max-message-bytes", int, "largest gRPC message in either direction"),
    ("--event-loop", str, "auto | asyncio | uvloop (auto: uvloop when installed)"),
    ("--cpu-latency-us", str, "hold this bound on the host's CPU wake-up latency while serving "
     "(/dev/cpu_dma_latency, needs root; 0: idle CPUs poll; default off)"),
    (
        "--token",
        str,
        "shared bearer token required on every call and sent to peers "
        "(prefer MICROSERVING_SHIM_TOKEN: flags show in ps)",
    ),
    ("--tls-cert", str, "PEM certificate of this shim (serves TLS; client cert to peers)"),
    ("--tls-key", str, "PEM key of --tls-cert"),
    ("--tls-ca", str, "CA bundle: requires client certificates (mutual TLS), verifies peers"),
    ("--tls-server-name", str, "override of the name checked in peers' certificates"),
    ("--synthetic-step-ms", str, "synthetic backend: decode step ms by batch, e.g. "
     "1:1.03,32:1.33,128:2.01 (default; llama-1b on an H200)"),
    ("--synthetic-prefill-tok-s", float, "synthetic backend: prefill tokens/s (default 120000)"),
    ("--log-level", str, "logging level"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="microserving shim",
        description="Serve one engine over gRPC (microserving.v1.Engine). Every flag also reads "
        "MICROSERVING_SHIM_<NAME> (e.g. MICROSERVING_SHIM_TOKEN, MICROSERVING_SHIM_TLS_CERT).",
    )
    for flag, kind, help_ in _FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=help_)
    return parser


def parse_settings(argv: list[str]) -> ShimSettings:
    args = vars(_parser().parse_args(argv))
    return ShimSettings(**{name: value for name, value in args.items() if value is not None})


async def run(settings: ShimSettings) -> int:
    from engine_shim.server import ShimServer

    server = ShimServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    freeze_startup_heap()  # the engine loaded: full collections walk only what serving makes
    if server.metrics_server is not None:
        print(f"microserving shim metrics on http://{settings.host}:{server.metrics_server.port}/metrics", flush=True)
    print(f"microserving shim listening on {server.address}", flush=True)
    logger.info("serving %s (%s backend) on %s", settings.model, settings.backend, server.address)
    stopped = asyncio.ensure_future(stop.wait())
    lost = asyncio.ensure_future(server.backend.wait_lost())
    await asyncio.wait([stopped, lost], return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, lost):
        task.cancel()
    if lost.done() and not lost.cancelled():
        # Crash-only: a shim whose engine is gone exits, so its supervisor restarts it and
        # routers see it leave instead of sending work to an engine that cannot answer.
        logger.error("the engine is gone (%s): stopping the shim", lost.result())
        await server.stop(0.0)
        return 1
    logger.info("draining for up to %.1f s", settings.drain_grace_s)
    await server.stop()
    return 0


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
    except ValidationError as error:
        print(f"microserving shim: invalid settings:\n{error}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    tracing.configure("shim")
    if not cpu_latency.hold_for_service(settings.cpu_latency_us, "microserving shim"):  # until the exit
        return 1
    if settings.tune_malloc:
        tune_for_large_buffers()
    return loop_runner(settings.event_loop)(run(settings))
