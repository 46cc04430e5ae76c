"""What a worker's devices are doing: GPU utilisation and memory through NVML (the driver's management
library, read through `nvidia-ml-py`'s ctypes binding; nothing when there is no driver), and a process
tree's resident memory (a CPU trainer's memory, psutil).

Two readers: each training step's metric row (worker/reporter.py: `gpu_utilization`, `gpu_memory_bytes`,
`rss_bytes`, charted by the dashboard's job page), and each worker's row at every reconciler pass (the
workers page and Prometheus' `tunehouse_worker_*` gauges, service/ops.py). A sample costs a few
milliseconds; a step reads one at most every SAMPLE_SECONDS.
"""

from __future__ import annotations

import logging
import os
import time
from functools import lru_cache
from typing import Any

log = logging.getLogger("tunehouse.worker")

SAMPLE_SECONDS = 1.0


@lru_cache
def _nvml() -> Any | None:
    """The initialised NVML module, or None without a driver (a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no device: a CPU host
        return None
    return pynvml


def _visible(count: int) -> list[int]:
    """The NVML indices of the GPUs this process sees (CUDA_VISIBLE_DEVICES by index; all without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    return [int(i) for i in visible.split(",") if i.strip().isdigit() and int(i) < count]


def gpu_stats() -> list[dict[str, Any]]:
    """Per visible GPU: index, name, utilisation (%, over the driver's last sample period), memory used and
    total (bytes); [] on a host without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    out = []
    for index in _visible(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = nvml.nvmlDeviceGetName(handle)
        out.append(
            {
                "index": index,
                "name": name.decode() if isinstance(name, bytes) else str(name),
                "utilization": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                "memory_used_bytes": int(memory.used),
                "memory_total_bytes": int(memory.total),
            }
        )
    return out


def tree_rss(pid: int | None = None) -> int:
    """Resident bytes of a process and its children (a worker and its trainer, a trainer and its ranks)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += int(proc.memory_info().rss)
        except psutil.Error:  # a child that exited meanwhile
            continue
    return total


def step_sample() -> dict[str, float]:
    """A step row's device figures: this process tree's RSS, and over its GPUs the mean utilisation and
    the memory in use."""
    sample: dict[str, float] = {"rss_bytes": float(tree_rss())}
    gpus = gpu_stats()
    if gpus:
        sample["gpu_utilization"] = sum(g["utilization"] for g in gpus) / len(gpus)
        sample["gpu_memory_bytes"] = float(sum(g["memory_used_bytes"] for g in gpus))
    return sample


class StepSampler:
    """The latest `step_sample`, taken again once SAMPLE_SECONDS have passed: a fast loop's steps share
    one reading rather than paying for one each."""

    def __init__(self) -> None:
        self._at = -float("inf")
        self._last: dict[str, float] = {}

    def __call__(self) -> dict[str, float]:
        now = time.monotonic()
        if now - self._at >= SAMPLE_SECONDS:
            try:
                self._last = step_sample()
            except Exception:  # a figure we cannot read never stops a job
                log.debug("device sample failed", exc_info=True)
                self._last = {}
            self._at = now
        return self._last


def worker_stats() -> dict[str, Any]:
    """A worker's live figures for its row: its GPUs and its process tree's RSS (the trainers included)."""
    try:
        return {"gpus": gpu_stats(), "rss_bytes": tree_rss(), "sampled_at": time.time()}
    except Exception:
        log.debug("worker stats failed", exc_info=True)
        return {"gpus": [], "rss_bytes": None, "sampled_at": time.time()}
