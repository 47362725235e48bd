"""Imported first by a benchmark script of this folder run as a program (`python -m bench.<name>`
or `python bench/<name>.py`) rather than through the `microserving` command (which does the
same before any gRPC loads): the script's own gRPC calls then go through the I/O stack that
the stack's processes use (microserving/grpc_io.py), so a timed call costs what the router's
calls cost, not EventEngine's extra thread hops. Imported as a library (a test, another
program) it changes nothing: the choice is the program's, made before gRPC loads."""

import sys
from pathlib import Path

from microserving.grpc_io import prefer_legacy_io


def _runs_a_bench_script() -> bool:
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is not None and Path(main_file).resolve().parent == Path(__file__).resolve().parent


if _runs_a_bench_script():
    prefer_legacy_io()
