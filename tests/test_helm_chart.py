"""The Helm chart (deploy/helm/tunehouse) rendered by Helm's own engine with each values file of its ci/
folder, and every object validated against the Kubernetes API's JSON schemas.

No helm or kubeconform binary can be downloaded here, so: `helm-python-sdk` (Helm 4's Go SDK behind a C
ABI, in its wheel: the real template engine, Sprig functions and values.schema.json check, not a Python
imitation) renders, and `kubernetes-validate` (the Kubernetes OpenAPI schemas per version, as a package)
validates in strict mode (an unknown field is an error). The custom resources (KubeRay's RayCluster,
Prometheus Operator's ServiceMonitor) have no schema there: their pod templates are validated as core/v1
PodTemplates, and their own fields are checked here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")  # the dev extra pins it
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "tunehouse"
KUBERNETES = "1.30"  # the oldest version the chart supports well after Chart.yaml's floor
MINIMAL = {"postgresql": {"url": "postgresql+psycopg://t@db/t"}, "redis": {"url": "redis://r:6379"}}
VALUES = {"minimal": MINIMAL} | {
    p.stem: yaml.safe_load(p.read_text()) for p in sorted(CHART.glob("ci/*.yaml"))
}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = chart.render(values, name="th", namespace="ml")
    return [
        doc
        for name, text in sorted(manifests.items())
        if name.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] == "RayCluster":
        spec = obj["spec"]
        return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return []


@pytest.mark.parametrize("case", list(VALUES))
def test_every_object_is_valid_against_the_kubernetes_schemas(chart: Any, case: str) -> None:
    objects = render(chart, VALUES[case])
    assert objects
    for obj in objects:
        where = f"{case}: {obj['kind']} {obj['metadata']['name']}"
        if obj["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1"):
            for template in _pod_templates(obj):
                pod = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": template,
                }
                kubernetes_validate.validate(pod, KUBERNETES, strict=True)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{where}: {exc.message} at {list(exc.path)}") from exc


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_gpu_pools_workers_and_their_shutdown(chart: Any) -> None:
    objects = render(chart, VALUES["external-gpu-pools"])
    deployments = _by_kind(objects, "Deployment")
    h100 = deployments["th-tunehouse-worker-h100"]["spec"]
    pod = h100["template"]["spec"]
    worker = pod["containers"][0]
    assert h100["replicas"] == 4 and worker["command"] == ["tunehouse", "worker"]
    assert worker["resources"]["limits"] == {"memory": "128Gi", "nvidia.com/gpu": 1}
    assert worker["image"] == "tunehouse:0.1.0-cuda"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    # the pod outlives the worker's checkpoint-and-hand-back on SIGTERM
    assert pod["terminationGracePeriodSeconds"] > 60
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["TUNEHOUSE_WORKER_GPUS"] == "1"
    a10 = deployments["th-tunehouse-worker-a10"]["spec"]["template"]["spec"]["containers"][0]
    assert a10["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert {e["name"]: e.get("value") for e in a10["env"]}["TUNEHOUSE_WORKER_GPUS"] == "4"
    for name, command in (("inference", "--inference"), ("tinker", "--tinker")):
        side = deployments[f"th-tunehouse-{name}"]["spec"]["template"]["spec"]["containers"][0]
        assert side["command"] == ["tunehouse", "worker", command]
        assert side["resources"]["limits"] == {"nvidia.com/gpu": 1}
    api = deployments["th-tunehouse-api"]["spec"]["template"]["spec"]
    assert api["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for d in deployments.values():  # the image's unprivileged user, everywhere
        assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    config = _by_kind(objects, "ConfigMap")["th-tunehouse-config"]["data"]
    assert config["TUNEHOUSE_MODEL_CACHE_GB"] == "500" and config["TUNEHOUSE_SHARED_BASE_JOBS"] == "4"
    secret = _by_kind(objects, "Secret")["th-tunehouse-secrets"]["stringData"]
    assert secret["broker-url"] == "redis://redis.internal:6379/0"
    assert secret["redis-url"] == "redis://redis.internal:6379/1"
    monitor = _by_kind(objects, "ServiceMonitor")["th-tunehouse"]["spec"]["endpoints"][0]
    assert (monitor["path"], monitor["bearerTokenSecret"]["key"]) == ("/metrics", "metrics-token")
    migrate = _by_kind(objects, "Job")
    assert [j["metadata"]["annotations"]["helm.sh/hook"] for j in migrate.values()] == [
        "post-install,pre-upgrade"
    ]


def test_bundled_services_and_the_ray_cluster(chart: Any) -> None:
    trial = render(chart, VALUES["bundled-trial"])
    secret = _by_kind(trial, "Secret")["th-tunehouse-secrets"]["stringData"]
    assert secret["database-url"].endswith("@th-tunehouse-postgresql:5432/tunehouse")
    assert set(_by_kind(trial, "Service")) >= {
        "th-tunehouse-postgresql",
        "th-tunehouse-redis",
        "th-tunehouse-minio",
    }
    assert "th-tunehouse-worker-cpu" in _by_kind(trial, "Deployment")
    ray = render(chart, VALUES["ray-existing-secret"])
    assert not _by_kind(ray, "Secret")  # the operator's own Secret is used
    cluster = _by_kind(ray, "RayCluster")["th-tunehouse-ray"]["spec"]
    assert cluster["workerGroupSpecs"][0]["replicas"] == 4
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": 8}
    config = _by_kind(ray, "ConfigMap")["th-tunehouse-config"]["data"]
    assert config["TUNEHOUSE_RAY_ADDRESS"] == "ray://th-tunehouse-ray-head-svc:10001"


def test_values_are_checked_against_the_schema(chart: Any) -> None:
    with pytest.raises(helm.HelmError, match="gpusPerWorker"):
        chart.render(
            {**MINIMAL, "gpuPools": [{"name": "gpu", "gpusPerWorker": 0}]}, name="th", namespace="ml"
        )
    with pytest.raises(helm.HelmError, match=r"NOT_OURS. does not match"):
        chart.render({**MINIMAL, "config": {"NOT_OURS": "1"}}, name="th", namespace="ml")
    # no database given: the render says which value to set
    with pytest.raises(helm.HelmError, match=r"postgresql.url \(or bundled.postgresql.enabled\)"):
        chart.render({}, name="th", namespace="ml")
