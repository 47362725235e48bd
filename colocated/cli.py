"""`microserving serve`: `microserving gateway`'s flags, with `--router-config FILE` (what
`microserving router --config` takes) in place of `--router`: the router runs in the
gateway's process, one per worker."""

from __future__ import annotations

import os
import sys

from pydantic import ValidationError

from colocated.app import ROUTER_CONFIG_ENV, create_serve_app, router_settings
from gateway.cli import build_parser, serve, settings_from_namespace


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    parser.prog = "microserving serve"
    parser.description = ("The OpenAI HTTP gateway with the router in its own process "
                          "(each worker its own router).")
    parser.add_argument("--router-config", required=True, metavar="FILE",
                        help="the router's settings, YAML or JSON, as `microserving router "
                             "--config FILE` takes them (MICROSERVING_ROUTER_* override them)")
    known = parser.parse_args(args)
    if known.router is not None:
        parser.error("--router names a router process; serve runs its own (--router-config)")
    config_file = known.router_config
    del known.router_config
    try:
        settings = settings_from_namespace(known)
        router = router_settings(config_file)
    except (ValidationError, ValueError) as error:
        print(f"microserving serve: {error}", file=sys.stderr)
        return 2
    if settings.workers > 1 and router.metrics_port:
        print("microserving serve: with --workers, the router's metrics_port must be 0 or unset "
              "(its metrics are on the gateway's /metrics)", file=sys.stderr)
        return 2
    os.environ[ROUTER_CONFIG_ENV] = str(config_file)
    return serve(settings, lambda: create_serve_app(settings, router, freeze_heap=True),
                 "colocated.app:app_from_worker_env",
                 f"router in process: {router.pattern}, {len(router.engines)} engines")


if __name__ == "__main__":
    sys.exit(main())
