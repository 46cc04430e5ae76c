"""The FastAPI application: routers, the error envelope, health and Prometheus metrics."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, select, text

from service.base_models.routes import router as models_router
from service.config import get_settings
from service.db import get_engine, get_sessionmaker
from service.errors import install_error_handlers
from service.files.routes import router as files_router
from service.jobs.routes import router as jobs_router
from service.models import Job

log = logging.getLogger("tunehouse.api")


def _configure_logging() -> None:
    # uvicorn configures only its own loggers; ours need a handler to reach the server's log
    logger = logging.getLogger("tunehouse")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(get_settings().log_level.upper())


def create_app() -> FastAPI:
    _configure_logging()
    app = FastAPI(title="tunehouse", version="0.1.0", description="OpenAI-compatible training service")
    install_error_handlers(app)
    app.include_router(files_router)
    app.include_router(jobs_router)
    app.include_router(models_router)

    @app.middleware("http")
    async def request_id(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        rid = request.headers.get("x-request-id") or f"req_{uuid.uuid4().hex}"
        started = time.perf_counter()
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        log.info(
            "%s %s %s %.1fms request_id=%s",
            request.method,
            request.url.path,
            response.status_code,
            (time.perf_counter() - started) * 1000,
            rid,
        )
        return response

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    def readyz() -> Response:
        try:
            with get_engine().connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # readiness reports, it does not raise
            return PlainTextResponse(f"database unavailable: {type(exc).__name__}", status_code=503)
        return PlainTextResponse("ready")

    @app.get("/metrics", include_in_schema=False)
    def prometheus() -> PlainTextResponse:
        with get_sessionmaker()() as session:
            counts = dict(
                session.execute(select(Job.status, func.count()).group_by(Job.status)).tuples().all()
            )
        lines = ["# HELP tunehouse_jobs Fine-tuning jobs by status.", "# TYPE tunehouse_jobs gauge"]
        for status in ("validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"):
            lines.append(f'tunehouse_jobs{{status="{status}"}} {counts.get(status, 0)}')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


app = create_app()
