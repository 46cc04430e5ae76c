"""The deployment files hold together: docker-compose.yml (with its GPU override), the Dockerfile and
docs/deploy.md. No Docker daemon runs here, so the stack is not started; this checks its structure
against the code: every service a service depends on exists, the workers can be scaled and share no
volume with the API, the environment is one that service/config.py accepts and points at the
compose services, and every `TUNEHOUSE_*` setting the docs name is a real one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def _compose(name: str = "docker-compose.yml") -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / name).read_text())
    assert isinstance(loaded, dict)
    return loaded


def _setting_names() -> set[str]:
    return {f"TUNEHOUSE_{name.upper()}" for name in Settings.model_fields}


def test_services_and_dependencies() -> None:
    services = _compose()["services"]
    assert {"postgres", "redis", "s3", "migrate", "bucket", "api", "worker"} <= set(services)
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for dep, how in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on a missing service {dep}"
            assert how["condition"] in ("service_healthy", "service_completed_successfully"), name
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
    for one_shot in ("migrate", "bucket"):
        assert services["api"]["depends_on"][one_shot]["condition"] == "service_completed_successfully"
        assert services["worker"]["depends_on"][one_shot]["condition"] == "service_completed_successfully"


def test_workers_scale_and_share_nothing_with_the_api() -> None:
    services = _compose()["services"]
    worker = services["worker"]
    # `--scale worker=N` refuses a fixed container name or a published host port
    assert "container_name" not in worker and "ports" not in worker
    # no shared volume: API and workers meet only through PostgreSQL, Redis and the blob store
    assert "volumes" not in worker and "volumes" not in services["api"]
    assert worker["command"] == ["tunehouse", "worker"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "tunehouse" in scripts
    # the stop timeout covers the trainer's hand-back (checkpoint + requeue) on SIGTERM
    grace = int(str(worker["stop_grace_period"]).removesuffix("s"))
    assert grace > Settings().shutdown_grace_seconds


def test_environment_is_valid_settings_pointing_at_the_compose_services(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compose = _compose()
    services = compose["services"]
    env = compose["x-tunehouse-env"]
    for name in ("api", "worker", "migrate", "bucket"):
        assert services[name]["environment"] == env, name
    unknown = {k for k in env if k.startswith("TUNEHOUSE_")} - _setting_names()
    assert not unknown, f"not settings of service/config.py: {unknown}"
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    settings = Settings()
    assert settings.blob_url.startswith("s3://") and settings.database_url.startswith("postgresql")
    hosts = {
        urlsplit(settings.database_url).hostname,
        urlsplit(settings.broker_url).hostname,
        urlsplit(settings.redis_url).hostname,
        urlsplit(env["AWS_ENDPOINT_URL"]).hostname,
    }
    assert hosts == {"postgres", "redis", "s3"}
    # the bucket the one-shot creates is the one the blob URL names
    bucket = settings.blob_url.removeprefix("s3://").split("/")[0]
    assert f'"{bucket}"' in "\n".join(services["bucket"]["command"])
    # MinIO's root user is the credential the services use
    s3_env = services["s3"]["environment"]
    assert (s3_env["MINIO_ROOT_USER"], s3_env["MINIO_ROOT_PASSWORD"]) == (
        env["AWS_ACCESS_KEY_ID"],
        env["AWS_SECRET_ACCESS_KEY"],
    )


def test_gpu_override_reserves_gpus_for_workers_only() -> None:
    services = _compose("docker-compose.gpu.yml")["services"]
    assert set(services) == {"worker", "inference"}  # training and inference workers, never the API
    for name in services:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "deploy" not in _compose()["services"][name]  # the default file runs on CPU hosts


def test_dockerfile_copies_what_exists_and_installs_every_runtime_extra() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line
    install = next(line for line in lines if 'pip install --no-cache-dir ".[' in line)
    extras = set(install.split("[")[1].split("]")[0].split(","))
    runtime = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras == runtime - {"dev", "local"}  # server, train, trackers and ray: one image for every role
    # runs as the unprivileged user the Helm chart's securityContext names
    assert "USER 10001" in lines and any("useradd --uid 10001" in line for line in lines)


def test_worker_only_compose_runs_one_worker_per_gpu_and_nothing_else() -> None:
    compose = _compose("docker-compose.worker.yml")
    services = compose["services"]
    workers = {n: s for n, s in services.items() if n.startswith("worker-gpu")}
    gpus = []
    for name, service in services.items():
        # no PostgreSQL, Redis or S3 here, and nothing waits for them: they are remote
        assert "depends_on" not in service and "build" not in service, name
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device and len(device["device_ids"]) == 1, name
        unknown = {k for k in service["environment"] if k.startswith("TUNEHOUSE_")} - _setting_names()
        assert not unknown, unknown
        if name in workers:
            gpus.append(device["device_ids"][0])
            assert service["command"] == ["tunehouse", "worker"]
    assert gpus == [str(i) for i in range(len(workers))]  # each its own GPU
    assert services["tinker"]["command"] == ["tunehouse", "worker", "--tinker"]
    # `--profile gpus-N` starts exactly N workers
    for n in (2, 4, 8):
        started = [w for w, s in workers.items() if not s.get("profiles") or f"gpus-{n}" in s["profiles"]]
        assert len(started) == n, (n, started)
    example = dict(
        line.split("=", 1) for line in (ROOT / ".env.worker.example").read_text().splitlines() if "=" in line
    )
    required = set(re.findall(r"\$\{(\w+):\?", (ROOT / "docker-compose.worker.yml").read_text()))
    assert required <= set(example), required - set(example)


# variables the SDK and the test suite read, not the server's settings
NOT_SETTINGS = {"TUNEHOUSE_BASE_URL", "TUNEHOUSE_API_KEY", "TUNEHOUSE_TEST_POSTGRES", "TUNEHOUSE_TEST_REDIS"}


def test_docs_name_only_real_settings() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the settings are in operations.md
    for doc in docs:
        named = set(re.findall(r"TUNEHOUSE_[A-Z_]+[A-Z]", doc.read_text())) - NOT_SETTINGS
        unknown = sorted(named - _setting_names())
        assert not unknown, f"{doc.name} names unknown settings {unknown}"
