"""Browser fixtures: Debian's Chromium driven by Playwright against the live stack (uvicorn + Celery
worker + PostgreSQL + Redis, `tests.conftest.stack`).

Every page records console errors, uncaught exceptions, failed requests and HTTP errors; a test
fails on any it did not announce with `ui.allow(...)`. Screenshots go to one folder under the run's
tmp dir, printed at the end of the run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
TIMEOUT_MS = 60_000  # generous: 8 helpers share 2 cores

_shots_dir: list[Path] = []


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dashboard-screenshots")
    _shots_dir.append(path)
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for path in _shots_dir:
        terminalreporter.write_line(f"dashboard screenshots: {path}")


@dataclass
class UI:
    """One browser tab on the dashboard, with its problems recorded."""

    page: Any
    base_url: str
    shots: Path
    problems: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def allow(self, pattern: str) -> None:
        """Tolerate problems matching `pattern` (e.g. the 400 a test provokes on purpose)."""
        self.allowed.append(re.compile(pattern))

    def record(self, problem: str) -> None:
        self.problems.append(problem)

    def unexpected(self) -> list[str]:
        return [p for p in self.problems if not any(a.search(p) for a in self.allowed)]

    def goto(self, route: str) -> None:
        self.page.goto(f"{self.base_url}/#/{route}")

    def sign_in(self, key: str) -> None:
        self.goto("signin")
        self.page.get_by_label("API key").fill(key)
        self.page.get_by_role("button", name="Sign in").click()
        self.page.get_by_role("heading", name="Fine-tuning jobs").wait_for()

    def shot(self, name: str, *, full_page: bool = True) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        return path


def open_ui(browser: Any, base_url: str, shots: Path, viewport: dict[str, int]) -> tuple[Any, UI]:
    context = browser.new_context(viewport=viewport, accept_downloads=True)
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    ui = UI(page=page, base_url=base_url, shots=shots)
    page.on("console", lambda m: m.type == "error" and ui.record(f"console: {m.text}"))
    page.on("pageerror", lambda e: ui.record(f"uncaught: {e}"))

    def on_failed(request: Any) -> None:
        # a stream (or poll) the page aborts on purpose when leaving a view is not a failure
        if request.failure != "net::ERR_ABORTED":
            ui.record(f"request failed: {request.method} {request.url} {request.failure}")

    page.on("requestfailed", on_failed)
    page.on(
        "response", lambda r: r.status >= 400 and ui.record(f"http {r.status}: {r.request.method} {r.url}")
    )
    return context, ui


@pytest.fixture
def ui(browser: Any, stack: Any, shots: Path) -> Iterator[UI]:
    context, ui = open_ui(browser, stack.url, shots, DESKTOP)
    yield ui
    context.close()
    assert not ui.unexpected(), ui.unexpected()
