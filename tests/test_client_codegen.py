"""The client templates generate from proto/ with local plugins only: buf.gen.yaml gives a
TypeScript client (protoc-gen-es from tools/package.json), buf.gen.go.yaml a Go client
(protoc-gen-go and protoc-gen-go-grpc from Debian). Each is run into a tmp dir and the output
must declare every service of the contract."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUF = ROOT / "tools" / "node_modules" / ".bin" / "buf"
PROTOC_GEN_ES = ROOT / "tools" / "node_modules" / ".bin" / "protoc-gen-es"
SERVICES = ("Engine", "KVTransfer", "Router")
# The Go plugins are not npm packages; scripts/test.sh installs them where it can (root + apt).
GO_INSTALL = "apt-get install protoc-gen-go protoc-gen-go-grpc"


def generate(template: str, out: Path) -> dict[str, str]:
    """Runs `buf generate` with one template into out; returns {relative path: text}."""
    if not BUF.exists():
        pytest.skip("buf is not installed: run `npm ci` in tools/")
    result = subprocess.run([str(BUF), "generate", "--template", template, "-o", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()}


def test_typescript_client_generates_every_service(tmp_path: Path) -> None:
    if not PROTOC_GEN_ES.exists():
        pytest.skip("protoc-gen-es is not installed: run `npm ci` in tools/")
    files = generate("buf.gen.yaml", tmp_path)
    assert set(files) == {f"gen/ts/microserving/v1/{name}_pb.ts"
                          for name in ("common", "engine", "router")}
    source = "\n".join(files.values())
    for service in SERVICES:
        assert re.search(rf"^export const {service}: GenService<", source, re.MULTILINE), service
    # A streaming method keeps its kind, so Connect/gRPC-web clients call it as a stream.
    assert re.search(r'generate: \{\s*methodKind: "bidi_streaming"', files[
        "gen/ts/microserving/v1/router_pb.ts"])


def test_go_client_generates_every_service(tmp_path: Path) -> None:
    missing = [p for p in ("protoc-gen-go", "protoc-gen-go-grpc") if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not on PATH (install: {GO_INSTALL})")
    files = generate("buf.gen.go.yaml", tmp_path)
    generated = "gen/go/microserving/v1"
    assert {f"{generated}/{name}.pb.go" for name in ("common", "engine", "router")} <= set(files)
    for service, proto in (("Engine", "engine"), ("KVTransfer", "engine"), ("Router", "router")):
        stubs = files[f"{generated}/{proto}_grpc.pb.go"]
        assert f"type {service}Client interface" in stubs
        assert f"func New{service}Client(" in stubs
    # go_package in the protos decides the package name of every generated file.
    assert all(text.count("\npackage microservingv1\n") == 1 for text in files.values())
