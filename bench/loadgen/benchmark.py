"""One benchmark run from its settings to its files: workload, load, summary, JSON, plots."""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen.client import RequestOptions
from bench.loadgen.plots import plot_cdfs
from bench.loadgen.results import machine_info, record_to_json, write_results
from bench.loadgen.runner import LoadShape, run_load
from bench.loadgen.stats import summarize
from bench.loadgen.workload import WorkloadConfig, build_workload, is_local_model


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run needs; `model=None` asks the server's /v1/models."""

    base_url: str
    workload: WorkloadConfig
    shape: LoadShape
    model: str | None = None
    endpoint: str = "completions"
    num_prompts: int = 100
    warmup: int = 2
    temperature: float = 0.0
    ignore_eos: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0
    label: str = "run"
    extra_body: dict[str, Any] = field(default_factory=dict)
    # The workload's lengths are defaults, not the user's: shrink them to the served context.
    fit_to_context: bool = False


def normalize_base_url(url: str) -> str:
    """Accept `http://host:port` or `http://host:port/v1`; return the /v1 form."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int | None  # the context length, when the server reports it


async def served_model(base_url: str, api_key: str | None, model: str | None) -> ServedModel:
    """`model` (default: the first listed) and its context length from /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(trust_env=False) as session,
            session.get(f"{base_url}/models", headers=headers) as response,
        ):
            response.raise_for_status()
            cards = (await response.json()).get("data") or []
    except aiohttp.ClientError:
        if model is None:
            raise
        cards = []  # a server without /v1/models: the given model, context unknown
    if model is None and not cards:
        raise ValueError(f"{base_url}/models lists no model; pass --model")
    if model is None:
        card, model = cards[0], str(cards[0]["id"])
    else:
        card = next((c for c in cards if c.get("id") == model), {})
    length = card.get("max_model_len")
    return ServedModel(model, int(length) if isinstance(length, int) else None)


# Room for what the prompt gains on the server (bos, a chat template's tokens).
_CONTEXT_MARGIN_TOKENS = 32


def fit_workload(workload: WorkloadConfig, model: ServedModel, fit_lengths: bool) -> WorkloadConfig:
    """Lengths in the served model's tokens when its tokenizer is at hand (a preset name or a
    local directory), and default lengths shrunk to fit its context."""
    tokenizer = workload.tokenizer or (model.id if is_local_model(model.id) else None)
    fitted = replace(workload, tokenizer=tokenizer)
    if not (fit_lengths and model.max_model_len and workload.dataset == "synthetic"):
        return fitted
    num_in, num_out = int(workload.input_len), int(workload.output_len)
    room = model.max_model_len - _CONTEXT_MARGIN_TOKENS
    if num_in + num_out <= room:
        return fitted
    num_out = min(num_out, room // 4)
    return replace(fitted, input_len=str(room - num_out), output_len=str(num_out))


def _config_json(config: BenchConfig, model: str) -> dict[str, Any]:
    data = asdict(config)
    shape = data.pop("shape")
    data.update(shape, model=model)
    if data.get("request_rate") is not None and math.isinf(data["request_rate"]):
        data["request_rate"] = "inf"
    data.pop("api_key")  # never written to disk
    return data


async def run_benchmark(
    config: BenchConfig, *, command: list[str] | None = None, show_progress: bool = True
) -> dict[str, Any]:
    """Run the benchmark and return its results (config, machine, summary, requests)."""
    base_url = normalize_base_url(config.base_url)
    served = await served_model(base_url, config.api_key, config.model)
    model = served.id
    config = replace(config, workload=fit_workload(config.workload, served, config.fit_to_context))
    specs = build_workload(config.workload, config.warmup + config.num_prompts)
    options = RequestOptions(
        base_url=base_url,
        model=model,
        endpoint=config.endpoint,
        temperature=config.temperature,
        ignore_eos=config.ignore_eos,
        api_key=config.api_key,
        timeout_s=config.timeout_s,
        extra_body=config.extra_body,
    )
    outcome = await run_load(
        specs[config.warmup :],
        options,
        config.shape,
        warmup=specs[: config.warmup],
        show_progress=show_progress,
    )
    summary = summarize(outcome.records, outcome.duration_s)
    summary["max_in_flight"] = outcome.max_in_flight
    return {
        "config": _config_json(config, model),
        "machine": machine_info(command),
        "summary": summary,
        "requests": [record_to_json(r) for r in outcome.records],
    }


def save_run(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """results.json and cdf.png in out_dir."""
    return [write_results(out_dir, result), plot_cdfs([result], out_dir / "cdf.png")]


def run_and_save(config: BenchConfig, out_dir: Path | None, **kwargs: Any) -> dict[str, Any]:
    result = asyncio.run(run_benchmark(config, **kwargs))
    if out_dir is not None:
        save_run(result, out_dir)
    return result
