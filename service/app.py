"""The FastAPI application: routers, the error envelope, request guards, health and Prometheus metrics."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from service.config import get_settings
from service.dashboard.routes import mount_dashboard
from service.db_reads import close_read_connections
from service.db_slots import size_threadpool
from service.dependencies import reject_unsafe_url
from service.errors import install_error_handlers
from service.files.routes import router as files_router
from service.files.upload import max_body_bytes as max_upload_body_bytes
from service.graders.routes import router as graders_router
from service.graders.service import require_python_grader_sandbox
from service.inference.routes import router as inference_router
from service.jobs.methods_api import router as methods_router
from service.jobs.routes import router as jobs_router
from service.logs import configure_logging
from service.middleware import BodyGuard, RequestContext
from service.models_api.routes import router as models_router
from service.openapi import install_openapi
from service.ops import router as ops_router
from service.shutdown import install_drain_on_signals
from service.tinker.routes import router as tinker_router
from service.webhooks.routes import router as webhooks_router
from service.workers_api.routes import router as workers_router


def _freeze_startup_heap() -> None:
    """Leave what the imports built out of every later garbage collection. Why: the app's modules,
    routes and models are ~145,000 objects that live as long as the process, and a full collection
    walked them all while every request on the event loop waited: most of a job's read's p99
    at 50 connections (git log -p docs/benchmarks.md). Frozen after one last collection, they are never walked
    again."""
    gc.collect()
    gc.freeze()


@asynccontextmanager
async def _lifespan(_: FastAPI) -> AsyncIterator[None]:
    require_python_grader_sandbox(get_settings())  # enabled python graders: refuse to start unsandboxed
    install_drain_on_signals()  # here, not at import: the server has installed its handlers by now
    size_threadpool()
    _freeze_startup_heap()
    yield
    await close_read_connections()


def create_app() -> FastAPI:
    configure_logging()
    settings = get_settings()
    app = FastAPI(
        title="tunehouse",
        version="0.1.0",
        description="OpenAI-compatible training service",
        lifespan=_lifespan,
        dependencies=[Depends(reject_unsafe_url)],
    )
    install_error_handlers(app)
    app.include_router(files_router)
    app.include_router(jobs_router)
    app.include_router(models_router)
    app.include_router(inference_router)
    app.include_router(methods_router)
    app.include_router(webhooks_router)
    app.include_router(graders_router)
    app.include_router(tinker_router)
    app.include_router(workers_router)
    mount_dashboard(app)
    app.include_router(ops_router)
    install_openapi(app)
    # added last = outermost: the request id is on every response, the guard's answers included
    app.add_middleware(
        BodyGuard,
        max_body_bytes=settings.max_json_body_bytes,
        # the upload streams and bounds itself: as a whole, its file's limit and the multipart framing
        streamed={("POST", files_router.prefix): max_upload_body_bytes(settings.max_upload_bytes)},
    )
    app.add_middleware(RequestContext)
    return app


app = create_app()
