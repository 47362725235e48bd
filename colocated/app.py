"""The app of `microserving serve`: the gateway's, with a router of its own in the process."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI
from pydantic import ValidationError

from gateway.app import create_app
from gateway.settings import GatewaySettings, settings_from_worker_env
from router.inprocess import InProcessRouter
from router.router import Router
from router.router_class import load_router_class
from router.settings import RouterSettings, load_settings

# The variable that hands a worker process the router's settings file (not a setting itself).
ROUTER_CONFIG_ENV = "MICROSERVING_SERVE_ROUTER_CONFIG"


def router_settings(config_file: Path | str) -> RouterSettings:
    """The router's settings: `config_file` (as `microserving router --config` reads it), under
    the MICROSERVING_ROUTER_* environment. Raises ValueError, naming the file, when invalid."""
    try:
        settings = load_settings(str(config_file))
        if settings.router_class:
            load_router_class(settings.router_class)  # fails here, before serving
    except (ValidationError, ValueError, OSError) as error:
        raise ValueError(f"router settings from {config_file}: {error}") from None
    return settings


def build_router(settings: RouterSettings) -> InProcessRouter:
    router_type = load_router_class(settings.router_class) if settings.router_class else Router
    return InProcessRouter(router_type(settings=settings))


def create_serve_app(settings: GatewaySettings, router: RouterSettings,
                     freeze_heap: bool = False) -> FastAPI:
    return create_app(settings, freeze_heap=freeze_heap, router=lambda: build_router(router))


def app_from_worker_env() -> FastAPI:
    """The app of one worker of `microserving serve --workers N`: a gateway and a router of its
    own (N router replicas over the same engines, load counts taken from the engines)."""
    router = router_settings(os.environ[ROUTER_CONFIG_ENV])
    return create_serve_app(settings_from_worker_env(), router, freeze_heap=True)
