"""Loads a user's Router subclass (`--router-class`, MICROSERVING_ROUTER_ROUTER_CLASS), so a
custom translate_request runs under `microserving router`, `microserving up`, compose and
Kubernetes, not only under serve(). Two spellings:

    package.module:Class      imported from sys.path (the working directory, PYTHONPATH)
    /path/to/file.py:Class    loaded from that file (e.g. a file mounted into a container)
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from router.router import Router


def _module(source: str) -> ModuleType:
    if source.endswith(".py"):
        path = Path(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if not path.is_file() or spec is None or spec.loader is None:
            raise ValueError(f"--router-class: no Python file at {source}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(source)
    except ImportError as exc:
        raise ValueError(f"--router-class: cannot import {source!r}: {exc} "
                         "(is it on PYTHONPATH? a file path ending in .py works too)") from exc


def load_router_class(spec: str) -> type[Router]:
    """The Router subclass `spec` names; ValueError with the reason otherwise."""
    source, sep, class_name = spec.rpartition(":")
    if not sep or not source or not class_name:
        raise ValueError(f"--router-class wants package.module:Class or file.py:Class, got {spec!r}")
    found: object = _module(source)
    for part in class_name.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ValueError(f"--router-class: {source!r} has no {class_name!r}")
    if not (isinstance(found, type) and issubclass(found, Router)):
        raise ValueError(f"--router-class: {spec} is not a subclass of router.Router")
    return found
