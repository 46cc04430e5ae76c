"""A worker's device figures (worker/devices.py). NVML needs an NVIDIA driver, which no machine here has:
`gpu_stats` is checked against a stand-in of the `pynvml` module (the one mock, and only of the driver);
the RSS figures are a real process tree's."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from worker import devices


class FakeNVML:
    """Two GPUs as NVML reports them: names as bytes (older bindings) and str, utilisation in %."""

    GPUS = ((b"NVIDIA H100 80GB HBM3", 87, 40 * 2**30), ("NVIDIA H100 80GB HBM3", 13, 2 * 2**30))

    def nvmlDeviceGetCount(self) -> int:
        return len(self.GPUS)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> Any:
        return self.GPUS[handle][0]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=self.GPUS[handle][1])

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return SimpleNamespace(used=self.GPUS[handle][2], total=80 * 2**30)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_nvml", lambda: FakeNVML())


def test_gpu_figures_of_the_visible_gpus(two_gpus: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    stats = devices.gpu_stats()
    assert [(g["index"], g["name"], g["utilization"]) for g in stats] == [
        (0, "NVIDIA H100 80GB HBM3", 87.0),
        (1, "NVIDIA H100 80GB HBM3", 13.0),
    ]
    sample = devices.step_sample()
    assert sample["gpu_utilization"] == 50.0 and sample["gpu_memory_bytes"] == 42 * 2**30
    # a trainer given GPU 1 alone reads GPU 1 alone
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    sample = devices.step_sample()
    assert sample["gpu_utilization"] == 13.0 and sample["gpu_memory_bytes"] == 2 * 2**30


def test_a_host_without_a_driver_reports_memory_only() -> None:
    assert devices.gpu_stats() == []  # no NVIDIA driver here: NVML does not initialise
    assert set(devices.step_sample()) == {"rss_bytes"}


def test_rss_counts_the_children_too() -> None:
    # a child holding 200 MB: the tree's RSS grows by about that, the parent's own does not
    code = "import time; b = bytearray(200 * 2**20); print(1, flush=True); time.sleep(60)"
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline()
            alone = devices.tree_rss(child.pid)
            assert alone > 200 * 2**20
            assert devices.tree_rss() >= alone  # this process and its child
        finally:
            child.kill()


def test_steps_share_one_reading_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter(range(100))
    monkeypatch.setattr(devices, "step_sample", lambda: {"rss_bytes": float(next(readings))})
    sampler = devices.StepSampler()
    assert [sampler()["rss_bytes"] for _ in range(50)] == [0.0] * 50
    monkeypatch.setattr(devices, "SAMPLE_SECONDS", 0.05)
    time.sleep(0.06)
    assert sampler()["rss_bytes"] == 1.0
