"""One benchmark run from its settings to its files: workload, load, summary, JSON, plots."""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.loadgen.client import RequestOptions
from bench.loadgen.plots import plot_cdfs
from bench.loadgen.results import machine_info, record_to_json, write_results
from bench.loadgen.runner import LoadShape, run_load
from bench.loadgen.stats import summarize
from bench.loadgen.workload import WorkloadConfig, build_workload


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


def normalize_base_url(url: str) -> str:
    """Accept `http://host:port` or `http://host:port/v1`; return the /v1 form."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def first_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        aiohttp.ClientSession(trust_env=False) as session,
        session.get(f"{base_url}/models", headers=headers) as response,
    ):
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise ValueError(f"{base_url}/models lists no model; pass --model")
    return str(models[0]["id"])


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
    model = config.model or await first_model(base_url, config.api_key)
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
