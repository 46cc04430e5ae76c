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


def test_dockerfile_copies_what_exists_and_installs_the_server() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line
    install = next(line for line in lines if "pip install" in line)
    assert "server" in install  # boto3 (S3) and the API/worker dependencies


# variables the SDK and the test suite read, not the server's settings
NOT_SETTINGS = {"TUNEHOUSE_BASE_URL", "TUNEHOUSE_API_KEY", "TUNEHOUSE_TEST_POSTGRES", "TUNEHOUSE_TEST_REDIS"}


def test_docs_name_only_real_settings() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the settings are in operations.md
    for doc in docs:
        named = set(re.findall(r"TUNEHOUSE_[A-Z_]+[A-Z]", doc.read_text())) - NOT_SETTINGS
        unknown = sorted(named - _setting_names())
        assert not unknown, f"{doc.name} names unknown settings {unknown}"
