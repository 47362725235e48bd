"""The `microserving` console script: dispatches a subcommand to the service that owns it.

Each service keeps its own CLI (`<package>.cli:main(argv)`); this module only maps names to
them and imports lazily, so `microserving gateway` never loads torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

from microserving.grpc_io import prefer_legacy_io

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "shim": ("engine_shim.cli", "run a gRPC engine shim (embedded or MLC backend)"),
    "mlc-compat": ("engine_shim.mlc_http.cli", "serve the embedded engine over MLC's HTTP wire format"),
    "router": ("router.cli", "run the gRPC router"),
    "gateway": ("gateway.cli", "run the OpenAI HTTP gateway"),
    "serve": ("colocated.cli", "run the gateway with the router in its process (no router hop)"),
    "up": ("microserving.stack.up", "start a whole local stack: shims, router and gateway"),
    "bench": ("bench.cli", "benchmark an OpenAI-compatible server"),
}


def _version() -> str:
    try:
        return importlib.metadata.version("microserving-grpc")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


# subcommand -> (a module it needs, the extra that installs it)
_NEEDS = {
    "shim": ("torch", "engine"), "mlc-compat": ("torch", "engine"), "up": ("torch", "engine"),
    "bench": ("aiohttp", "bench"),
}


def _missing_extra(name: str) -> str | None:
    """A message when the subcommand needs an extra that is not installed (the control
    plane installs without torch)."""
    if name not in _NEEDS:
        return None
    module, extra = _NEEDS[name]
    if importlib.util.find_spec(module) is not None:
        return None
    return f"needs {module}: pip install 'microserving-grpc[{extra}]'"


def _usage() -> str:
    lines = ["usage: microserving [--version] <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"microserving {_version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"microserving: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    missing = _missing_extra(name)
    if missing is not None:
        print(f"microserving {name}: {missing}", file=sys.stderr)
        return 2
    prefer_legacy_io()  # before any gRPC: microserving/grpc_io.py
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
