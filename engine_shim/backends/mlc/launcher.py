"""Optionally starts `mlc_llm serve MODEL --model-lib LIB --mode server --enable-debug` when
the shim is given no --mlc-url and the command is installed (MLC-LLM is not on PyPI)."""

from __future__ import annotations

import asyncio
import shutil

import httpx

from engine_shim.engine.api import UnavailableError
from microserving.stack.process import free_port

STARTUP_TIMEOUT_S = 600.0


class MLCProcess:
    def __init__(self, model: str, model_lib: str | None, *, enable_prefix_cache: bool = True) -> None:
        self._model = model
        self._model_lib = model_lib
        self._enable_prefix_cache = enable_prefix_cache
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> str:
        command = shutil.which("mlc_llm")
        if command is None or self._model_lib is None:
            raise UnavailableError(
                "the mlc backend needs --mlc-url, or `mlc_llm` installed and --mlc-model-lib"
            )
        port = free_port()
        self._process = await asyncio.create_subprocess_exec(
            command,
            "serve",
            self._model,
            "--model-lib",
            self._model_lib,
            "--mode",
            "server",
            "--enable-debug",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            # MLC's router starts its engines the same way for enable_prefix_cache=False.
            *(() if self._enable_prefix_cache else ("--overrides", "prefix_cache_mode=disable")),
        )
        url = f"http://127.0.0.1:{port}"
        await self._wait_ready(url)
        return url

    async def _wait_ready(self, url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            deadline = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
            while asyncio.get_running_loop().time() < deadline:
                if self._process is not None and self._process.returncode is not None:
                    raise UnavailableError(f"mlc_llm serve exited with {self._process.returncode}")
                try:
                    if (await client.get("/v1/models")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1.0)  # start-up of an external process: nothing to await
        raise UnavailableError("mlc_llm serve did not come up in time")

    async def stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            await self._process.wait()
