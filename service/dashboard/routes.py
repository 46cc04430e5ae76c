"""The web dashboard: `/` serves the page, `/dashboard/...` its static files (ES modules, CSS, the
vendored chart library). No build step, nothing from the internet: the page talks only to the
public `/v1` API with the API key the user signs in with, exactly as the SDK does.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

STATIC_DIR = Path(__file__).parent / "static"

# 'self' only: the page must work offline, so any attempt to reach another origin is a bug we want
# the browser to refuse (and the browser tests to see as a console error).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
# Revalidate on every load: a deployment upgrade must never leave a browser on a stale module
# that no longer matches the API. Files are small and answer 304 when unchanged.
HEADERS = {"content-security-policy": CSP, "cache-control": "no-cache", "x-content-type-options": "nosniff"}


class _Static(StaticFiles):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                raw = list(message.get("headers", []))  # type: ignore[call-overload]
                raw += [(k.encode(), v.encode()) for k, v in HEADERS.items()]
                message = {**message, "headers": raw}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)  # type: ignore[arg-type]


def mount_dashboard(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers=HEADERS)

    app.mount("/dashboard", _Static(directory=STATIC_DIR), name="dashboard")
