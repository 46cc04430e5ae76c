"""One rank of a multi-node job, as Ray Train runs it (worker/ray_driver.py): the training function of
its `TorchTrainer`, run in a Ray worker process on some node of the cluster.

Ray Train has joined the ranks' process group already (gloo on CPUs, NCCL on GPUs, with the job's
collective timeout) and set `RANK`, `LOCAL_RANK` and `WORLD_SIZE`; from there the rank is a rank of a
one-host multi-GPU job: `worker.job_process.run`, where rank 0 loads the inputs, reports metrics, events
and checkpoints and records the outcome, and the others train their share. It reads the database, Redis
and the blob store with the driver's `TUNEHOUSE_*` settings (passed in the job's runtime environment).

A rank runs on a thread of its Ray worker process, where no signal handler can be set: it never sees a
SIGTERM. Cancel and pause reach it as on one host, through rank 0's stop decision broadcast each step; a
worker that shuts down stops the driver, and Ray ends the driver's ranks with it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from worker import job_process


def train_rank(config: dict[str, Any]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job_process.run(str(config["job_id"]), str(config["worker_id"]), shutdown=threading.Event())
