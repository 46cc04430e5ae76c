"""PostgreSQL stopped and restarted while a job trains: the trainer keeps training with its metric
rows buffered (and still published live on Redis), the supervisor's heartbeats ride out the gap, and
once the database is back every step is recorded exactly once. A live stream
open across the outage stays open and misses nothing."""

from __future__ import annotations

import json
import time

import httpx
import redis

from service.jobs.live import channel, message_rows
from tests.faults.jobs import StreamReader, assert_ran_once, create_job, wait_metrics
from tests.faults.servers import FaultStack
from tests.helpers import chat_rows, upload_ok, wait_for

OUTAGE_SECONDS = 6.0


def test_postgres_restart_mid_job(fault_stack: FaultStack) -> None:
    # a lease outlives the outage: the job stays with its worker instead of being handed over
    fault_stack.extra_env["TUNEHOUSE_LEASE_TIMEOUT_SECONDS"] = "30"
    url, _ = fault_stack.start_api()
    fault_stack.start_worker()
    key = fault_stack.new_key()
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    train = upload_ok(client, chat_rows(64))
    # no step checkpoints: recording a checkpoint waits for the database by design, so one falling in
    # the outage window would (rightly) pause training. 6,400 steps: far more than any machine trains
    # while the test watches (CI once finished 96 steps before the stop); once the database is back the
    # job is paused (its trainer writes its last rows and exits), then cancelled
    job_id = create_job(client, train, n_epochs=100, batch_size=1, learning_rate=1e-3)
    wait_metrics(client, job_id, at_least=2)
    live = redis.Redis.from_url(f"{fault_stack.redis.url}/1").pubsub()
    live.subscribe(channel(job_id))
    reader = StreamReader(url, key, job_id)

    fault_stack.pg.stop()
    stopped_at = time.monotonic()
    statuses: list[int | str] = []  # what the API answers meanwhile (rel. issue 12: 503, not 500)
    published: list[int] = []
    while time.monotonic() - stopped_at < OUTAGE_SECONDS:
        try:
            statuses.append(client.get(f"/v1/fine_tuning/jobs/{job_id}").status_code)
        except httpx.TransportError as exc:
            statuses.append(type(exc).__name__)
        while (message := live.get_message(ignore_subscribe_messages=True, timeout=0.2)) is not None:
            rows = message_rows(json.loads(message["data"])) or []  # None: a nudge
            published.extend(int(row["step"]) for row in rows)
    assert published, "the trainer stopped training while the database was down"
    fault_stack.pg.start()
    outage = time.monotonic() - stopped_at
    live.close()

    wait_metrics(client, job_id, at_least=published[-1] + 3, timeout=240)  # recorded, and on it goes
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/pause").status_code == 200
    assert wait_for(client, job_id, statuses=("paused",), timeout=120)["status"] == "paused"
    assert client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    done = time.monotonic() - stopped_at
    # every step's row, none twice; no second start, no takeover
    job = assert_ran_once(client, job_id, status="cancelled")
    reader.assert_complete(client)
    print(
        f"\npostgres outage {outage:.1f}s: the trainer published steps {published[0]}..{published[-1]} "
        f"meanwhile; API answered {sorted(set(map(str, statuses)))} during it; {job['current_step']} "
        f"steps recorded once each by the pause, {done:.1f}s after the stop"
    )
    client.close()
