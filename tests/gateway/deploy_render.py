"""Test helpers that read the deployment files as a tool would: a minimal kustomize renderer
(resources, namespace, images, JSON6902 patches, labels) and compose-file variable interpolation."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*)|:?\?[^}]*)?\}")


def interpolate(value: Any, environ: dict[str, str] | None = None) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}` substitution, recursively."""
    env = os.environ if environ is None else environ
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    return value


def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.split("/")[1:]]


def apply_json_patch(document: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    for operation in operations:
        *parents, last = _pointer(operation["path"])
        target: Any = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if operation["op"] not in ("add", "replace"):
            raise ValueError(f"unsupported patch op {operation['op']}")
        if isinstance(target, list):
            index = len(target) if last == "-" else int(last)
            if operation["op"] == "add":
                target.insert(index, operation["value"])
            else:
                target[index] = operation["value"]
        else:
            if operation["op"] == "replace" and last not in target:
                raise KeyError(f"replace of missing {operation['path']}")
            target[last] = operation["value"]


def _matches(document: dict[str, Any], target: dict[str, Any]) -> bool:
    return all(document.get(k) == v if k == "kind" else document["metadata"].get(k) == v
               for k, v in target.items())


def _set_images(document: dict[str, Any], images: list[dict[str, str]]) -> None:
    spec = document.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []):
        for image in images:
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"


def render_kustomization(folder: Path) -> list[dict[str, Any]]:
    """The documents `kubectl kustomize folder` would print (for the features used here)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    documents: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = folder / resource
        if path.is_dir():
            documents += render_kustomization(path)
        else:
            documents += [d for d in yaml.safe_load_all(path.read_text()) if d]
    documents = copy.deepcopy(documents)
    for patch in spec.get("patches", []):
        text = patch["patch"] if "patch" in patch else (folder / patch["path"]).read_text()
        matched = [d for d in documents if _matches(d, patch["target"])]
        if not matched:
            raise ValueError(f"patch target {patch['target']} matches nothing")
        for document in matched:
            apply_json_patch(document, yaml.safe_load(text))
    for document in documents:
        if "namespace" in spec and document["kind"] != "Namespace":
            document["metadata"]["namespace"] = spec["namespace"]
        _set_images(document, spec.get("images", []))
        for label in spec.get("labels", []):
            document["metadata"].setdefault("labels", {}).update(label["pairs"])
    return documents
