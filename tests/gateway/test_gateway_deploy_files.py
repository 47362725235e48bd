"""The container and cluster files are valid for their tools: the compose files against the
compose-spec schema, the rendered Kubernetes overlays against the Kubernetes schemas, and both
wired the same way (env config, gRPC health probes, only the gateway exposed)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_render import interpolate, render_kustomization

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
COMPOSE_FILES = ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.mlc.yml"]
KUBERNETES_VERSION = "1.30"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_matches_the_compose_spec(name: str) -> None:
    checker = Path(sys.executable).with_name("check-jsonschema")
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec",
                             str(ROOT / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = interpolate(
        yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {})["services"]
    return services


def test_compose_publishes_only_the_gateway_and_starts_in_health_order() -> None:
    services = compose_services()
    assert set(services) == {"prefill", "decode", "router", "gateway"}
    assert [name for name, s in services.items() if s.get("ports")] == ["gateway"]
    assert services["router"]["depends_on"] == {
        "prefill": {"condition": "service_healthy"}, "decode": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {"router": {"condition": "service_healthy"}}
    for name in ("prefill", "decode", "router"):
        assert services[name]["healthcheck"]["test"][3:6] == ["gateway.probe", "grpc",
                                                             "127.0.0.1:50051"]
    assert services["prefill"]["environment"]["MICROSERVING_SHIM_ROLE"] == "prefill"


def test_gpu_override_reserves_an_nvidia_gpu_per_shim() -> None:
    override = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
    for name in ("prefill", "decode"):
        devices = override[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert override[name]["environment"]["MICROSERVING_SHIM_DEVICE"] == "cuda"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_overlay_renders_to_valid_manifests(overlay: str) -> None:
    documents = render_kustomization(KUBERNETES / "overlays" / overlay)
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in documents)
    assert ("Deployment", "microserving-prefill") in kinds
    assert ("Service", "microserving-gateway") in kinds


def by_name(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name)


def test_kubernetes_engines_are_discovered_through_headless_services() -> None:
    documents = render_kustomization(KUBERNETES / "overlays" / "cpu")
    config = by_name(documents, "ConfigMap", "microserving-config")["data"]
    dns = yaml.safe_load(config["MICROSERVING_ROUTER_ENGINE_DNS"])
    assert dns == ["microserving-prefill:50051=prefill", "microserving-decode:50051=decode"]
    for role in ("prefill", "decode"):
        service = by_name(documents, "Service", f"microserving-{role}")
        assert service["spec"]["clusterIP"] == "None"
        container = by_name(documents, "Deployment", f"microserving-{role}")[
            "spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["grpc"]["port"] == 50051
        assert container["livenessProbe"]["grpc"]["port"] == 50051
        assert "requests" in container["resources"]


def test_gpu_overlay_requests_gpus_and_the_cuda_image() -> None:
    documents = render_kustomization(KUBERNETES / "overlays" / "gpu")
    container = by_name(documents, "Deployment", "microserving-decode")[
        "spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == "registry.example.com/microserving/microserving-grpc:0.1.0-cuda"
    assert by_name(documents, "ConfigMap", "microserving-config")["data"][
        "MICROSERVING_SHIM_DEVICE"] == "cuda"


def test_compose_and_kubernetes_can_load_a_custom_router_class() -> None:
    router = interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()),
                         {"MICROSERVING_ROUTER_CLASS": "/custom/custom_router.py:CustomRouter",
                          "MICROSERVING_ENABLE_PREFIX_CACHE": "false"})["services"]
    assert router["router"]["environment"]["MICROSERVING_ROUTER_ROUTER_CLASS"] == \
        "/custom/custom_router.py:CustomRouter"
    assert router["router"]["volumes"] == ["./examples:/custom:ro"]  # where that file lies
    assert (ROOT / "examples" / "custom_router.py").is_file()
    assert router["decode"]["environment"]["MICROSERVING_SHIM_ENABLE_PREFIX_CACHE"] == "false"
    assert compose_services()["router"]["environment"]["MICROSERVING_ROUTER_ROUTER_CLASS"] == ""
    documents = render_kustomization(KUBERNETES / "overlays" / "cpu")
    config = by_name(documents, "ConfigMap", "microserving-config")["data"]
    assert config["MICROSERVING_ROUTER_ROUTER_CLASS"] == ""
    pod = by_name(documents, "Deployment", "microserving-router")["spec"]["template"]["spec"]
    assert pod["containers"][0]["volumeMounts"][0] == {
        "name": "router-code", "mountPath": "/custom", "readOnly": True}
    assert pod["volumes"][0]["configMap"] == {"name": "microserving-router-code", "optional": True}


def pods(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in documents if d["kind"] == "Deployment"}


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_pods_run_locked_down_with_the_role_image(overlay: str) -> None:
    documents = render_kustomization(KUBERNETES / "overlays" / overlay)
    for name, template in pods(documents).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        container = spec["containers"][0]
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]  # writable /tmp
        assert "memory" in container["resources"]["limits"]
        engine = name in ("microserving-prefill", "microserving-decode")
        image = container["image"]
        assert image.startswith("registry.example.com/microserving/")
        assert ("control-plane" not in image) == engine  # the router and gateway carry no torch
        token = next(e for e in container["env"] if e["name"].endswith("_TOKEN"))
        assert token["valueFrom"]["secretKeyRef"] == {"name": "microserving-secrets", "key": "internal-token"}
        annotations = template["metadata"]["annotations"]
        port = annotations["prometheus.io/port"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(port) in {p["containerPort"] for p in container["ports"]}


def test_kubernetes_router_replicas_share_load_through_a_headless_service() -> None:
    documents = render_kustomization(KUBERNETES / "overlays" / "cpu")
    assert by_name(documents, "Deployment", "microserving-router")["spec"]["replicas"] >= 2
    assert by_name(documents, "Service", "microserving-router")["spec"]["clusterIP"] == "None"
    config = by_name(documents, "ConfigMap", "microserving-config")["data"]
    assert config["MICROSERVING_GATEWAY_ROUTER"] == "dns:///microserving-router:50051"


def test_kubernetes_has_a_disruption_budget_per_role_and_ingress_only_along_the_path() -> None:
    documents = render_kustomization(KUBERNETES / "overlays" / "cpu")
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
               for d in documents if d["kind"] == "PodDisruptionBudget"}
    assert budgets == set(pods(documents))
    policies = {d["metadata"]["name"]: d["spec"] for d in documents if d["kind"] == "NetworkPolicy"}
    assert policies["microserving-default-deny"]["policyTypes"] == ["Ingress"]
    assert "ingress" not in policies["microserving-default-deny"]
    router_from = [rule["from"][0] for rule in policies["microserving-router"]["ingress"]]
    assert {"podSelector": {"matchLabels": {"microserving.io/tier": "gateway"}}} in router_from
    engine_from = [rule["from"][0] for rule in policies["microserving-engines"]["ingress"]]
    assert {"podSelector": {"matchLabels": {"microserving.io/tier": "router"}}} in engine_from
    assert {"podSelector": {"matchLabels": {"microserving.io/tier": "engine"}}} in engine_from
    tiers = {name: t["metadata"]["labels"]["microserving.io/tier"] for name, t in pods(documents).items()}
    assert tiers == {"microserving-prefill": "engine", "microserving-decode": "engine",
                     "microserving-router": "router", "microserving-gateway": "gateway"}
    for template in pods(documents).values():  # the default-deny policy selects every pod
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "microserving"


def checkov_or_skip() -> str:
    """scripts/test.sh exports CHECKOV (scripts/policy_tools.sh builds its venv); run alone,
    pytest finds it on PATH or skips."""
    checkov = os.environ.get("CHECKOV") or shutil.which("checkov")
    if not checkov:
        pytest.skip("checkov is not installed: run scripts/policy_tools.sh and set CHECKOV")
    return checkov


def run_checkov(checkov: str, documents: list[dict[str, Any]], path: Path) -> subprocess.CompletedProcess[str]:
    path.write_text(yaml.safe_dump_all(documents))
    return subprocess.run([checkov, "--config-file", str(KUBERNETES / ".checkov.yaml"), "-f", str(path)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubernetes_overlay_passes_the_policy_scanner(overlay: str, tmp_path: Path) -> None:
    """checkov over the rendered overlay, with the checks deploy/kubernetes/.checkov.yaml
    skips (and says why)."""
    checkov = checkov_or_skip()
    result = run_checkov(checkov, render_kustomization(KUBERNETES / "overlays" / overlay),
                         tmp_path / f"{overlay}.yaml")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_policy_scanner_fails_a_privileged_root_container(tmp_path: Path) -> None:
    """The same scan, config and all, fails once a pod loses its lock-down: the check above
    can fail."""
    checkov = checkov_or_skip()
    documents = render_kustomization(KUBERNETES / "overlays" / "cpu")
    gateway = by_name(documents, "Deployment", "microserving-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"] = {"privileged": True, "runAsUser": 0}
    result = run_checkov(checkov, [gateway], tmp_path / "privileged.yaml")
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    assert "CKV_K8S_16" in result.stdout  # "Container should not be privileged"


@pytest.mark.parametrize("mistake", ["misspelled field", "wrong type"])
def test_strict_schema_validation_refuses_what_a_cluster_would(mistake: str) -> None:
    """kubernetes-validate in strict mode (as kubeconform -strict): an unknown field, which
    the API server would drop or refuse, fails validation, as does a wrong type."""
    documents = render_kustomization(KUBERNETES / "overlays" / "cpu")
    router = copy.deepcopy(by_name(documents, "Deployment", "microserving-router"))
    kubernetes_validate.validate(router, KUBERNETES_VERSION, strict=True)
    container = router["spec"]["template"]["spec"]["containers"][0]
    if mistake == "misspelled field":
        container["imagePulPolicy"] = "Always"
    else:
        router["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, KUBERNETES_VERSION, strict=True)
