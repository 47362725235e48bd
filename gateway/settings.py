"""The gateway's settings: one pydantic-settings object, env prefix MICROSERVING_GATEWAY_.

The CLI fills it from flags; anything not given on the command line comes from the
environment. Unknown MICROSERVING_GATEWAY_* variables are rejected by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from microserving.cpu_latency import CpuLatencySetting

ENV_PREFIX = "MICROSERVING_GATEWAY_"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    router: str = Field(default="127.0.0.1:50051",
                        description="Address of the Router service, host:port; several "
                                    "comma-separated for router replicas (requests spread over them).")
    workers: int = Field(default=1, ge=1, le=64,
                         description="Gateway worker processes sharing the HTTP port (each with "
                                     "its own router streams); one Python process caps at one core.")
    reuse_port: bool = Field(
        default=True,
        description="With several workers: each listens on a socket of its own (SO_REUSEPORT; "
                    "the kernel spreads connections evenly over them, Linux only) rather than all "
                    "sharing one, where bursts of connections go to whichever worker wakes first.")
    worker_hang_timeout_s: float = Field(
        default=30.0, gt=0,
        description="With several workers on sockets of their own: a worker whose serving loop "
                    "has not answered the parent's ping for this long is replaced.")
    cpu_latency_us: CpuLatencySetting = Field(
        default=None,
        description="Hold this bound (microseconds) on the host's CPU wake-up latency while the "
                    "gateway runs (/dev/cpu_dma_latency; 0: idle CPUs poll instead of halting, "
                    "which takes about a millisecond off one request's first token on a VM); "
                    "needs root. Unset or 'off': none (microserving/cpu_latency.py).")
    host: str = Field(default="127.0.0.1", description="Interface the HTTP server binds.")
    port: int = Field(default=8000, ge=0, le=65535,
                      description="HTTP port; 0 picks a free one (the bound port is printed).")
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Accepted API keys (comma-separated in the environment); empty = open.")
    api_key_file: Path | None = Field(
        default=None, description="File with one accepted API key per line (added to api_keys).")
    max_inflight: int = Field(default=0, ge=0,
                              description="Generation requests served at once; 0 = unlimited. "
                                          "Requests over the limit get 429 with Retry-After.")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024,
        description="Largest request body accepted; larger ones get 413 before they are read.")
    body_timeout_s: float = Field(default=60.0, gt=0,
                                  description="Time a client has to send a request's whole body "
                                              "(408 after it).")
    header_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Time a connection has to complete a request's headers when no request is "
                    "in progress (closed after it).")
    max_choices_per_request: int = Field(
        default=256, ge=1,
        description="Most completions (prompts x n) one request may ask for; more is a 400. "
                    "Each counts against max_inflight.")
    router_streams: int = Field(
        default=16, ge=1,
        description="Most long-lived Router.GenerateBatched calls (per worker) the gateway "
                    "multiplexes requests on.")
    requests_per_router_stream: int = Field(
        default=16, ge=1,
        description="Open requests on each of those calls before another call is opened.")
    health_timeout_s: float = Field(default=2.0, gt=0,
                                    description="Deadline of the router health check behind /health.")
    served_model_name: str = Field(default="",
                                   description="Model id reported when the router lists none.")
    log_level: str = Field(default="info", description="Python log level of the gateway.")
    tls_ca: str | None = Field(default=None, description="CA bundle to verify the router (TLS).")
    tls_cert: str | None = Field(default=None, description="Client certificate for mutual TLS.")
    tls_key: str | None = Field(default=None, description="Client key for mutual TLS.")
    token: SecretStr | None = Field(default=None,
                                    description="Shared bearer token of the gRPC hops.")
    tls_server_name: str | None = Field(
        default=None, description="Override of the name checked in the router's certificate.")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [key.strip() for key in value.split(",") if key.strip()]
        return value

    @model_validator(mode="after")
    def _check_key_file(self) -> GatewaySettings:
        if self.api_key_file is not None and not self.api_key_file.is_file():
            raise ValueError(f"api_key_file: no such file: {self.api_key_file}")
        return self

    def all_api_keys(self) -> list[str]:
        keys = [key.get_secret_value() for key in self.api_keys]
        if self.api_key_file is not None:
            lines = self.api_key_file.read_text().splitlines()
            keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        return keys


def reject_unknown_env(environ: dict[str, str] | None = None) -> None:
    """Raises ValueError naming MICROSERVING_GATEWAY_* variables that match no setting."""
    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in GatewaySettings.model_fields}
    known.add(WORKER_SETTINGS_ENV)
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
    if unknown:
        raise ValueError(f"unknown gateway settings in the environment: {', '.join(unknown)}")


# The variable that hands a worker process its settings (not a setting itself).
WORKER_SETTINGS_ENV = "MICROSERVING_GATEWAY_WORKER_SETTINGS_JSON"


def worker_settings_json(settings: GatewaySettings) -> str:
    """The settings, secrets included, for worker processes (through their environment, which
    is where the API keys and token come from anyway: never on a command line)."""
    values = settings.model_dump(mode="json")
    values["api_keys"] = [key.get_secret_value() for key in settings.api_keys]
    values["token"] = settings.token.get_secret_value() if settings.token else None
    return json.dumps(values)


def settings_from_worker_env() -> GatewaySettings:
    return GatewaySettings.model_validate(json.loads(os.environ[WORKER_SETTINGS_ENV]))
