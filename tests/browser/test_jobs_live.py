"""The dashboard against real jobs training on the live stack: sign in, the list updates itself, the
job page's chart grows while the job runs, controls act (and show the API's errors), compare
overlays two runs, and the stream resumes with Last-Event-ID after a dropped connection.

The worker runs one job at a time: `long` (thousands of steps, cancelled from the page) runs first
and `short` (8 steps) queues behind it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser.conftest import UI
from tests.conftest import Stack, new_key
from tests.helpers import all_pages, chat_rows, upload_ok, wait_for

MODEL = "tunehouse/tiny-llama"


@pytest.fixture(scope="module")
def tenant(stack: Stack) -> Iterator[tuple[str, httpx.Client]]:
    key = new_key()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        yield key, client


def _create(client: httpx.Client, **spec: Any) -> str:
    hp = spec.pop("hp")
    body = {"model": MODEL, "method": {"type": "supervised", "supervised": {"hyperparameters": hp}}, **spec}
    response = client.post("/v1/fine_tuning/jobs", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["id"])


@pytest.fixture(scope="module")
def jobs(tenant: tuple[str, httpx.Client]) -> dict[str, str]:
    _, client = tenant
    train = upload_ok(client, chat_rows(16))
    long = _create(
        client,
        training_file=train,
        suffix="long-run",
        metadata={"sweep": "lr-a"},
        hp={"n_epochs": 100, "batch_size": 1, "learning_rate": 1e-3},
    )
    # every weight: it cannot join the long job's shared base (worker/shared_runs.py), so it waits queued
    # while the long one runs, as the list's status filter below shows
    short = _create(
        client, training_file=train, suffix="short-run", hp={"n_epochs": 1, "batch_size": 2, "lora": False}
    )
    return {"long": long, "short": short}


def _points(ui: UI, metric: str) -> int:
    return int(ui.page.locator(f'figure[data-metric="{metric}"]').get_attribute("data-points") or 0)


def test_sign_in_then_the_list_updates_itself(
    ui: UI, tenant: tuple[str, httpx.Client], jobs: dict[str, str]
) -> None:
    key, _ = tenant
    page = ui.page
    ui.allow(r"http 401: GET .*/v1/models|status of 401")
    ui.goto("jobs")
    page.get_by_label("API key").wait_for()  # not signed in: sent to sign-in
    page.get_by_label("API key").fill("th-0123456789abcdef-wrong")
    page.get_by_role("button", name="Sign in").click()
    page.get_by_text("Incorrect API key provided").wait_for()
    ui.shot("signin-error")

    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    long_row = page.locator(f'tr[data-job-id="{jobs["long"]}"]')
    long_row.wait_for()
    assert "long-run" in long_row.inner_text() and "supervised" in long_row.inner_text()
    assert "sweep=lr-a" in long_row.inner_text()
    # the row changes status with no reload: queued -> running, with progress
    page.locator(f'tr[data-job-id="{jobs["long"]}"][data-status="running"]').wait_for(timeout=180_000)
    page.wait_for_function(
        "id => /\\d+\\/\\d+ · \\d+%/.test(document.querySelector(`tr[data-job-id='${id}']`).innerText)",
        arg=jobs["long"],
    )
    ui.shot("jobs")

    # search by metadata, filter by status; both live in the URL and survive a reload
    page.get_by_label("Search").fill("lr-a")
    page.locator(f'tr[data-job-id="{jobs["short"]}"]').wait_for(state="detached")
    assert page.locator("tbody tr").count() == 1
    page.get_by_label("Search").fill("")
    page.get_by_label("Status").select_option("queued")
    page.locator(f'tr[data-job-id="{jobs["long"]}"]').wait_for(state="detached")
    assert "status=queued" in page.url
    page.reload()
    assert page.get_by_label("Status").input_value() == "queued"
    page.locator(f'tr[data-job-id="{jobs["short"]}"]').wait_for()
    assert page.locator(f'tr[data-job-id="{jobs["long"]}"]').count() == 0


def test_job_page_chart_grows_live_and_controls_act(
    ui: UI, tenant: tuple[str, httpx.Client], jobs: dict[str, str]
) -> None:
    key, client = tenant
    page = ui.page
    ui.sign_in(key)
    ui.goto(f"jobs/{jobs['long']}")
    page.locator('main[data-job-status="running"]').wait_for(timeout=180_000)
    page.wait_for_function(
        "() => +document.querySelector('figure[data-metric=\"loss\"]')?.dataset.points > 0"
    )
    first = _points(ui, "loss")
    # more points arrive over the stream without a reload
    page.wait_for_function(
        "n => +document.querySelector('figure[data-metric=\"loss\"]').dataset.points > n + 5", arg=first
    )
    assert page.locator(".stream-state").get_attribute("data-state") == "live"
    for metric in ("learning_rate", "grad_norm", "mean_token_accuracy"):
        assert page.locator(f'figure[data-metric="{metric}"]').count() == 1, metric
    page.get_by_text(re.compile(r"^.*Training started")).first.wait_for()
    # hyperparameters as stored (resolved)
    assert page.locator("table.kv tr", has_text="n_epochs").inner_text().split()[-1] == "100"

    # hover shows values in the legend
    canvas = page.locator('figure[data-metric="loss"] .u-over')
    box = canvas.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
    legend_value = page.locator('figure[data-metric="loss"] .u-legend .u-series').nth(1).locator(".u-value")
    assert re.match(r"^-?[\d.]+(e[-+]?\d+)?$", legend_value.inner_text()), legend_value.inner_text()

    # smoothing toggles and is kept in the URL
    page.get_by_label("Smooth", exact=True).check()
    assert "smooth=0.6" in page.url
    ui.shot("job-running")
    ui.shot("job-running-viewport", full_page=False)  # the one in README (docs/dashboard-job.png)

    # pause: whatever the API answers is shown (400/409 today for not-implemented/not-allowed, or 200)
    ui.allow(rf"http (400|409): POST .*/{jobs['long']}/pause|status of (400|409)")
    page.get_by_role("button", name="Pause").click()
    message = page.locator(".control-msg")
    message.filter(has_text=re.compile(r"Pause (requested\.|failed: .+)")).wait_for()
    if "failed" in message.inner_text():
        api_answer = client.post(f"/v1/fine_tuning/jobs/{jobs['long']}/pause").json()["error"]["message"]
        assert api_answer in message.inner_text()

    # cancel: the status changes on the page and the buttons follow the state
    page.get_by_role("button", name="Cancel").click()
    page.locator('main[data-job-status="cancelled"]').wait_for()
    assert page.locator(".pill").first.inner_text().strip() == "cancelled"
    assert page.get_by_role("button", name="Cancel").is_disabled()
    assert page.get_by_role("button", name="Pause").is_disabled()
    assert page.get_by_role("button", name="Resume").is_disabled()
    assert wait_for(client, jobs["long"])["status"] == "cancelled"
    page.locator('.stream-state[data-state="ended"]').wait_for()
    ui.shot("job-cancelled")


def test_compare_overlays_two_runs(ui: UI, tenant: tuple[str, httpx.Client], jobs: dict[str, str]) -> None:
    key, client = tenant
    # cancelled from the page by the test before, unless this test runs alone
    client.post(f"/v1/fine_tuning/jobs/{jobs['long']}/cancel")
    assert wait_for(client, jobs["long"])["status"] == "cancelled"
    assert wait_for(client, jobs["short"])["status"] == "succeeded"
    long_steps = len(all_pages(client, f"/v1/fine_tuning/jobs/{jobs['long']}/metrics"))
    page = ui.page
    ui.sign_in(key)
    for job_id in (jobs["long"], jobs["short"]):
        page.get_by_label(f"Select {job_id} to compare").check()
    page.get_by_role("button", name="Compare selected").click()
    page.wait_for_url(re.compile(r"#/compare\?ids="))
    loss = page.locator('figure[data-metric="loss"]')
    page.wait_for_function(
        "n => +document.querySelector('figure[data-metric=\"loss\"]')?.dataset.points === n",
        arg=long_steps + 8,
    )
    labels = loss.locator(".u-legend .u-series .u-label").all_inner_texts()
    assert any("long-run" in x for x in labels) and any("short-run" in x for x in labels), labels
    caption = page.locator("table.compare caption").inner_text()
    assert "n_epochs" in caption and "batch_size" in caption, caption
    for job_id in (jobs["long"], jobs["short"]):  # the latest loss of each run, from its stream
        page.locator("table.compare tbody tr", has_text=job_id[-6:]).filter(has_text="loss ").wait_for()
    ui.shot("compare")


def test_stream_resumes_with_last_event_id(
    ui: UI, tenant: tuple[str, httpx.Client], jobs: dict[str, str]
) -> None:
    """History comes from /metrics, then the stream from the step after it. The first stream
    connection drops after two events, the second answers 503: the page shows 'reconnecting', then
    resumes from the last id it saw; no event or step is lost or shown twice."""
    key, client = tenant
    job_id = jobs["short"]
    assert wait_for(client, job_id)["status"] == "succeeded"
    resume_from = "e0m8"  # every event, the metrics after the 8 steps loaded as history
    with client.stream(
        "GET", f"/v1/fine_tuning/jobs/{job_id}/stream", headers={"Last-Event-ID": resume_from}
    ) as response:
        frames = response.read().decode().split("\n\n")
    assert frames[0].startswith("event: event") and frames[1].startswith("event: event")
    truncated = "\n\n".join(frames[:2]) + "\n\n"
    last_id = re.findall(r"^id: (.+)$", frames[1], re.M)[0]

    calls: list[str | None] = []

    def handle(route: Any) -> None:
        calls.append(route.request.headers.get("last-event-id"))
        if len(calls) == 1:
            route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=truncated)
        elif len(calls) == 2:
            route.fulfill(status=503, json={"error": {"message": "unavailable", "type": "server_error"}})
        else:
            route.continue_()

    ui.allow(rf"http 503: GET .*/{job_id}/stream|status of 503")
    page = ui.page
    ui.sign_in(key)
    page.route(f"**/v1/fine_tuning/jobs/{job_id}/stream", handle)
    ui.goto(f"jobs/{job_id}")
    page.locator('.stream-state[data-state="reconnecting"]').wait_for()
    page.locator('.stream-state[data-state="ended"]').wait_for()
    assert calls == [resume_from, last_id, last_id]
    events = all_pages(client, f"/v1/fine_tuning/jobs/{job_id}/events")
    assert page.locator("ol.events li").count() == len(events)
    assert _points(ui, "loss") == 8
    assert page.locator('figure[data-metric="loss"]').get_attribute("data-last-step") == "8"
