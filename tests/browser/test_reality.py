"""The dashboard survives reality: a 5,000-step job (metric rows inserted straight into the DB, so no
worker spends minutes producing them) paints quickly and completely; a failed job shows its error
and fault; a phone-width screen stays usable; a lost connection is shown and recovers; a revoked key
returns the user to sign-in with the reason; every control has a label; the dark scheme works.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from tests.browser.conftest import PHONE, UI, open_ui
from tests.conftest import Stack

STEPS = 5000


@pytest.fixture(scope="module")
def tenant() -> tuple[str, str]:
    from service.auth import create_api_key
    from service.db import session_scope

    with session_scope() as session:
        tenant, key = create_api_key(session, tenant_name=f"browser-reality-{time.time_ns()}")
        return tenant.id, key


@pytest.fixture(scope="module")
def big_job(tenant: tuple[str, str]) -> str:
    """A DPO job that failed after 5,000 steps, written directly to the DB (job, events, metric rows)."""
    from service.db import session_scope
    from service.ids import new_id, now
    from service.jobs.events import add_event
    from service.models import Job, JobMetric

    tenant_id, _ = tenant
    job_id = new_id("ftjob")
    started = now() - 3600
    with session_scope() as session:
        session.add(
            Job(
                id=job_id,
                tenant_id=tenant_id,
                model="tunehouse/tiny-llama",
                training_file="file-dbinserted",
                method={
                    "type": "dpo",
                    "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 8, "beta": 0.1}},
                },
                suffix="five-thousand",
                seed=1,
                status="failed",
                error={
                    "code": "worker_lost",
                    "message": "the trainer died 3 times",
                    "param": None,
                    "fault": "system",
                },
                created_at=started - 60,
                started_at=started,
                finished_at=started + 3500,
                total_steps=STEPS,
                current_step=STEPS,
            )
        )
        session.flush()
        add_event(session, job_id, "Training started: 5000 steps")
        for s in range(1, STEPS + 1):  # a step event per step, as a trainer writes them
            add_event(session, job_id, f"Step {s}/{STEPS}", type="metrics", data={"step": s})
        session.add_all(
            JobMetric(
                job_id=job_id,
                step=s,
                epoch=s / STEPS,
                values={
                    "loss": 0.7 * math.exp(-s / 1500) + 0.05 * math.sin(s / 7),
                    "rewards/margins": 1 - math.exp(-s / 800),
                    "rewards/accuracies": min(1.0, 0.5 + s / 8000),
                    "learning_rate": 5e-6 * (1 - s / STEPS),
                    **({"valid_loss": 0.72 * math.exp(-s / 1500)} if s % 250 == 0 else {}),
                },
            )
            for s in range(1, STEPS + 1)
        )
        add_event(session, job_id, "Job failed: the trainer died 3 times", level="error")
    return job_id


def test_5000_step_job_paints_fast_and_whole(ui: UI, tenant: tuple[str, str], big_job: str) -> None:
    page = ui.page
    ui.sign_in(tenant[1])
    page.evaluate("id => { location.hash = `#/jobs/${id}` }", big_job)
    page.reload()  # a fresh document: performance timings start at this navigation
    page.wait_for_function(
        "n => document.querySelector('figure[data-metric=\"loss\"]')?.dataset.lastStep === String(n)",
        arg=STEPS,
    )
    all_drawn_ms = page.evaluate("performance.now()")
    first_paint_ms = page.evaluate("performance.getEntriesByName('tunehouse:first-chart-paint')[0].startTime")
    started = time.perf_counter()
    with httpx.Client(base_url=ui.base_url, headers={"Authorization": f"Bearer {tenant[1]}"}) as client:
        replay = client.get(f"/v1/fine_tuning/jobs/{big_job}/stream", timeout=60)
        replay_ms = (time.perf_counter() - started) * 1000
    assert replay.text.count("event: metrics") == STEPS
    print(
        f"\n5,000-step job (metric rows inserted into the DB): first chart paint {first_paint_ms:.0f} ms "
        f"after navigation start, all {STEPS} steps drawn by {all_drawn_ms:.0f} ms "
        f"(the SSE replay alone, read by httpx: {replay_ms:.0f} ms)"
    )
    loss = page.locator('figure[data-metric="loss"]')
    assert loss.get_attribute("data-points") == str(STEPS + STEPS // 250)  # loss + valid_loss on one chart
    assert page.locator('figure[data-metric="rewards/margins"]').count() == 1
    # failed job: its error, with whose fault it was
    error = page.locator(".error-box")
    assert "worker_lost" in error.inner_text() and "the trainer died 3 times" in error.inner_text()
    assert error.locator(".fault").get_attribute("data-fault") == "system"
    assert page.get_by_role("button", name="Cancel").is_disabled()
    # the events list keeps its last 500, but the 5,000 step events make room first: the job's start
    # and its failure both stay in view
    events = page.locator("ol.events > li")
    assert events.count() == 500
    assert events.first.inner_text().endswith("Job failed: the trainer died 3 times")
    assert events.last.inner_text().endswith("Training started: 5000 steps")
    # the page stays responsive: hovering moves the legend to another step
    box = loss.locator(".u-over").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + 20)
    step_at_quarter = int(loss.locator(".u-legend .u-series").first.locator(".u-value").inner_text())
    assert 900 < step_at_quarter < 1600, step_at_quarter
    ui.shot("job-5000-steps")


def _overflow(page: Any) -> int:
    return int(page.evaluate("document.documentElement.scrollWidth - window.innerWidth"))


def _unlabelled(page: Any) -> list[str]:
    return list(
        page.evaluate(
            """() => [...document.querySelectorAll('input, select, textarea, button')]
              .filter(el => !(el.labels?.length || el.getAttribute('aria-label')
                              || el.getAttribute('aria-labelledby')
                              || (el.tagName === 'BUTTON' && el.textContent.trim())))
              .map(el => el.outerHTML.slice(0, 120))"""
        )
    )


def test_phone_width_and_labels(
    browser: Any, stack: Stack, shots: Any, tenant: tuple[str, str], big_job: str
) -> None:
    context, ui = open_ui(browser, stack.url, shots, PHONE)
    try:
        page = ui.page
        ui.sign_in(tenant[1])
        page.locator(f'tr[data-job-id="{big_job}"]').wait_for()
        assert _overflow(page) <= 0 and not _unlabelled(page)
        ui.shot("phone-jobs")
        ui.goto(f"jobs/{big_job}")
        page.wait_for_function("() => document.querySelector('figure[data-metric=\"loss\"] canvas')")
        chart_width = page.locator('figure[data-metric="loss"]').bounding_box()
        assert chart_width is not None and chart_width["width"] <= PHONE["width"]
        assert _overflow(page) <= 0 and not _unlabelled(page)
        ui.shot("phone-job")
        for route in ("files", "new", "compare"):
            ui.goto(route)
            page.locator("main h1").wait_for()
            page.wait_for_load_state("networkidle")
            assert _overflow(page) <= 0, route
            assert not _unlabelled(page), (route, _unlabelled(page))
        ui.shot("phone-new-job")
    finally:
        context.close()
    assert not ui.unexpected(), ui.unexpected()


def test_keyboard_reaches_navigation_and_dark_scheme(ui: UI, tenant: tuple[str, str], big_job: str) -> None:
    page = ui.page
    ui.sign_in(tenant[1])
    page.reload()
    page.get_by_role("heading", name="Fine-tuning jobs").wait_for()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Skip to content"
    # the brand, then every link of the navigation in order, the last "New job"
    links = page.locator("#nav a").count()
    focused = []
    for _ in range(1 + links):
        page.keyboard.press("Tab")
        focused.append(page.evaluate("document.activeElement.textContent.trim()"))
    assert {"Jobs", "Files", "Workers", "New job"} <= set(focused) and focused[-1] == "New job", focused
    page.get_by_role("link", name="Files").focus()
    page.keyboard.press("Enter")
    page.get_by_role("heading", name="Files").wait_for()

    ui.goto(f"jobs/{big_job}")
    page.get_by_role("button", name="Switch to dark theme").click()
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    page.wait_for_function("() => document.querySelector('figure[data-metric=\"loss\"] canvas')")
    ui.shot("job-dark")
    page.get_by_role("button", name="Switch to light theme").click()


def test_lost_connection_is_shown_and_recovers(ui: UI, tenant: tuple[str, str]) -> None:
    page = ui.page
    ui.allow(r"ERR_INTERNET_DISCONNECTED|Failed to fetch|ERR_NAME|ERR_CONNECTION")
    ui.sign_in(tenant[1])
    banner = page.locator("#conn")
    assert banner.is_hidden()
    page.context.set_offline(True)
    banner.filter(has_text="Connection lost").wait_for()  # the next refresh (every 3 s) fails
    ui.shot("connection-lost")
    page.context.set_offline(False)
    banner.wait_for(state="hidden")
    page.get_by_role("heading", name="Fine-tuning jobs").wait_for()


@pytest.fixture
def revocable_key() -> Iterator[tuple[str, str]]:
    from service.auth import create_api_key
    from service.db import session_scope

    with session_scope() as session:
        tenant, key = create_api_key(session, tenant_name=f"browser-revoke-{time.time_ns()}")
    yield tenant.id, key


def test_revoked_key_returns_to_sign_in_with_the_reason(ui: UI, revocable_key: tuple[str, str]) -> None:
    from service.db import session_scope
    from service.models import ApiKey

    tenant_id, key = revocable_key
    page = ui.page
    ui.allow(r"http 401: GET .*/v1/|status of 401")
    ui.sign_in(key)
    ui.goto("files")
    page.get_by_role("heading", name="Files").wait_for()
    ui.goto("jobs")  # polls every 3 s
    with session_scope() as session:
        session.execute(
            update(ApiKey).where(ApiKey.tenant_id == tenant_id).values(revoked_at=int(time.time()))
        )
    page.get_by_text("The API refused the key: This API key has been revoked.").wait_for()
    assert "#/signin?next=" in page.url
    assert page.evaluate("sessionStorage.getItem('tunehouse.apiKey')") is None
