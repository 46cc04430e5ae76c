"""The signed-out page shows only sign-in; the workers page shows the live worker, its device, memory and
heartbeat, and the job of the signed-in tenant it is running; the job's page charts its trainer's
memory beside the loss."""

from __future__ import annotations

import re

import httpx

from tests.browser.conftest import UI
from tests.conftest import Stack, new_key
from tests.helpers import chat_rows, upload_ok, wait_for


def test_sign_in_page_shows_only_sign_in(ui: UI, stack: Stack) -> None:
    page = ui.page
    ui.goto("signin")
    page.get_by_label("API key").wait_for()
    assert not page.get_by_role("navigation", name="Main").is_visible()
    assert not page.get_by_role("button", name="Sign out").is_visible()
    ui.shot("signin")
    ui.sign_in(new_key())
    assert page.get_by_role("navigation", name="Main").is_visible()
    assert page.get_by_role("button", name="Sign out").is_visible()


def test_workers_page_shows_devices_heartbeat_and_the_running_job(ui: UI, stack: Stack) -> None:
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        train = upload_ok(client, chat_rows(40))
        method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 8, "batch_size": 2}}}
        job = client.post(
            "/v1/fine_tuning/jobs",
            json={"model": "tunehouse/tiny-llama", "training_file": train, "method": method},
        ).json()
        page = ui.page
        ui.sign_in(key)
        page.get_by_role("navigation").get_by_role("link", name="Workers").click()
        page.get_by_role("heading", name="Workers").wait_for()
        # the row of the worker running the job, with the job linked in it
        row = page.locator("tr[data-worker-id]", has=page.locator(f'a[href="#/jobs/{job["id"]}"]'))
        row.wait_for()
        assert row.locator('[data-field="device"]').inner_text().startswith("cpu")
        assert row.locator('[data-field="gpus"]').inner_text() == "none (CPU)"
        assert re.fullmatch(r"[\d.]+ (MB|GB)", row.locator('[data-field="rss"]').inner_text())
        assert re.fullmatch(r"\d+ s ago", row.locator('[data-field="heartbeat"]').inner_text())
        ui.shot("workers")

        row.locator(f'a[href="#/jobs/{job["id"]}"]').click()
        # the trainer's memory, charted from the step rows
        page.locator('figure.chart[data-metric="rss_bytes"]').wait_for()
        ui.shot("job-memory-chart")
        client.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
        wait_for(client, job["id"])
