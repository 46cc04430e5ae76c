"""The Tinker training-primitives API under the paths the official `tinker` SDK calls (`/api/v1/...`).

Auth: the SDK sends its key as `X-API-Key` and insists that it begins with `tml-`; a tunehouse key
`th-...` is given as `tml-th-...` (the prefix is dropped here), and every object is the key's tenant's.
Calls that compute (create_model, forward_backward, optim_step, save/load, sample) answer a future at
once (`{request_id}`); `retrieve_future` answers its result, `try_again`, or the failed-request shape
(`{error, category}`) that the SDK raises as `RequestFailedError`. Coverage: docs/tinker.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import APIKeyHeader
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.auth import tenant_of_key
from service.base_models.catalog import list_base_models
from service.base_models.tinker_checkpoints import (
    find_tinker_checkpoint,
    forget_tinker_checkpoint,
    run_checkpoints,
    set_tinker_checkpoint_ttl,
    tenant_checkpoints,
    tinker_path,
)
from service.base_models.weights import find_model_weights
from service.config import get_settings
from service.dependencies import SessionDep, SettingsDep
from service.errors import BadRequest, NotFound, Unauthorized, error_responses
from service.models import Tenant, TinkerCheckpoint, TinkerRun
from service.storage import get_blob_store
from service.tinker import checks, runs, schemas, sources, wire
from service.tinker.channel import Result
from service.tinker.service import ClientLost, Tinker, TinkerPath, guard
from trainers.formats import PRIMITIVE_LOSS_PROVENANCE

# Not in /openapi.json: the protocol is the SDK's (protobuf bodies included), documented in docs/tinker.md,
# and its `X-API-Key` scheme would be a second one beside the Bearer keys of /v1
router = APIRouter(
    prefix="/api/v1", tags=["tinker"], responses=error_responses(400, 401, 404, 503), include_in_schema=False
)
_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="`tml-` + a tunehouse API key")
TINKER_KEY_PREFIX = "tml-"


async def _tenant(key: Annotated[str | None, Depends(_key_header)]) -> Tenant:
    if not key:
        raise Unauthorized(
            "You didn't provide an API key: the Tinker SDK sends TINKER_API_KEY as X-API-Key "
            "(tml- followed by a tunehouse API key).",
            code="missing_api_key",
        )
    return await tenant_of_key(key.strip().removeprefix(TINKER_KEY_PREFIX))


_clients: dict[str, Tinker] = {}


async def _tinker() -> AsyncIterator[Tinker]:
    settings = get_settings()
    url = settings.redis_url
    if url not in _clients:
        _clients[url] = Tinker(url, settings.tinker_max_queued_calls)
    yield _clients[url]


TenantDep = Annotated[Tenant, Depends(_tenant)]
TinkerDep = Annotated[Tinker, Depends(_tinker)]


def _future(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id, **extra}


# --- service ----------------------------------------------------------------------------------------------


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(settings: SettingsDep, _tenant: TenantDep) -> dict[str, Any]:
    """The base models a training client may start from (`ft:` models of the tenant are accepted too)."""
    return {
        "supported_models": [
            {"model_name": entry.id, "trainable": True, "sampleable": True}
            for entry in list_base_models(settings)
        ]
    }


@router.post("/client/config")
async def client_config(_tenant: TenantDep) -> dict[str, Any]:
    # plain httpx transport and uncompressed proto bodies: what this server reads; no JWT exchange
    return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "proto_compress_fwdbwd": False}


@router.post("/client/dynamic_config")
async def client_dynamic_config(_tenant: TenantDep) -> dict[str, Any]:
    return {"sample_cancel_enabled": False}


def _commit(session: Session, fn: Any, /, **kwargs: Any) -> Any:
    """One durable write (service/tinker/runs.py) in its own transaction."""
    result = fn(session, **kwargs)
    session.commit()
    return result


async def _db(session: Session, fn: Any, /, **kwargs: Any) -> Any:
    return await run_in_threadpool(_commit, session, fn, **kwargs)


async def _live_session(tinker: Tinker, session: Session, tenant_id: str, session_id: str) -> None:
    """The session in Redis, put back from PostgreSQL when Redis lost it (a restart)."""
    try:
        await guard(tinker.heartbeat(tenant_id, session_id))
    except NotFound:
        row = await _db(session, runs.find_session, tenant_id=tenant_id, session_id=session_id)
        await guard(tinker.restore_session(tenant_id, session_id, row.user_metadata))


@router.post("/create_session")
async def create_session(
    body: schemas.CreateSession, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    metadata = body.user_metadata or {}
    session_id = await guard(tinker.create_session(tenant.id, metadata))
    await _db(session, runs.record_session, tenant_id=tenant.id, session_id=session_id, metadata=metadata)
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(
    body: schemas.SessionRef, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    await _live_session(tinker, session, tenant.id, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, body: schemas.FinishSession, tenant: TenantDep, session: SessionDep
) -> None:
    """`ServiceClient.close(status)`: the session's finish reason is kept (first wins); its clients stay
    usable until they are idle, as their state is the tenant's, not the session's."""
    await _db(
        session, runs.finish_session, tenant_id=tenant.id, session_id=session_id, reason=body.reason.type
    )


@router.get("/sessions/{session_id}")
async def get_session(
    session_id: str, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    row = await _db(session, runs.find_session, tenant_id=tenant.id, session_id=session_id)
    run_ids = await _db(session, runs.session_runs, tenant_id=tenant.id, session_id=session_id)
    return {
        "training_run_ids": run_ids,
        "sampler_ids": await guard(tinker.session_samplers(session_id)),
        "user_metadata": {k: str(v) for k, v in row.user_metadata.items()},
    }


@router.get("/sessions")
async def list_sessions(
    tenant: TenantDep, session: SessionDep, limit: int = 20, offset: int = 0
) -> dict[str, Any]:
    limit, offset = _page(limit, offset)
    ids = await _db(session, runs.list_sessions, tenant_id=tenant.id, limit=limit, offset=offset)
    return {"sessions": ids}


@router.post("/telemetry")
async def telemetry(_tenant: TenantDep) -> dict[str, str]:
    """The SDK's telemetry (on by default): accepted and dropped, so that clients run quietly; the server
    keeps its own metrics (/metrics) and the runs' (the dashboard)."""
    return {"status": "accepted"}


# --- training clients -------------------------------------------------------------------------------------


def _check_base(session: Session, tenant_id: str, name: str, param: str) -> None:
    weights = find_model_weights(session, get_settings(), tenant_id=tenant_id, name=name)
    if weights is None:
        raise BadRequest(
            f"{param}: no model '{name}' to train from in this organization",
            param=param,
            code="model_not_found",
        )
    if weights.reward_model:
        raise BadRequest(f"{param}: '{name}' is a reward model, not a language model", param=param)
    session.commit()


@router.post("/create_model")
async def create_model(
    body: schemas.CreateModel, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    """A LoRA training client on `base_model` (a base model, or the tenant's `ft:` model)."""
    if body.lora_config is None:
        raise BadRequest("lora_config: full fine-tuning is not served; give a LoRA rank", param="lora_config")
    if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
        raise BadRequest("optimizer_config: only AdamW (adamw) is served", param="optimizer_config")
    await run_in_threadpool(_check_base, session, tenant.id, body.base_model, "base_model")
    await _live_session(tinker, session, tenant.id, body.session_id)
    spec = body.lora_config.model_dump()
    model_id, host = await guard(
        tinker.register_model(
            tenant.id,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
            base_model=body.base_model,
            spec=spec,
            metadata=body.user_metadata or {},
        )
    )
    await _record_run(
        session, tenant.id, model_id, body.session_id, body.base_model, spec, body.user_metadata
    )
    args = {"model_id": model_id, "base_model": body.base_model, "spec": spec}
    request_id = await guard(tinker.send(host, "create_model", tenant.id, args, model_id=model_id))
    return _future(request_id, model_id)


async def _record_run(
    session: Session,
    tenant_id: str,
    run_id: str,
    session_id: str,
    base_model: str,
    spec: dict[str, Any],
    metadata: dict[str, Any] | None,
) -> None:
    await _db(
        session,
        runs.record_run,
        tenant_id=tenant_id,
        run_id=run_id,
        session_id=session_id,
        base_model=base_model,
        spec=spec,
        metadata=metadata or {},
    )


async def _host_of(tinker: Tinker, session: Session, tenant_id: str, model_id: str) -> str:
    """The live host of a run; a run that Redis lost (a restart) is known here but held nowhere: 410."""
    try:
        host: str = await guard(tinker.host_of(tenant_id, model_id))
    except NotFound:
        await _db(session, runs.find_run, tenant_id=tenant_id, run_id=model_id)
        raise ClientLost(model_id) from None
    return host


@router.post("/get_info")
async def get_info(body: schemas.ModelRef, tenant: TenantDep, session: SessionDep) -> dict[str, Any]:
    run: TinkerRun = await _db(session, runs.find_run, tenant_id=tenant.id, run_id=body.model_id)
    return {
        "type": "get_info",
        "model_id": body.model_id,
        "model_data": {"arch": "lora", "model_name": run.base_model, "tokenizer_id": run.base_model},
        "is_lora": True,
        "lora_rank": run.spec["rank"],
        "model_name": run.base_model,
    }


async def _proto_body(request: Request) -> bytes:
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise BadRequest(
            "Content-Encoding: compressed bodies are not read here; send them plain", param="body"
        )
    return await request.body()


@router.post("/forward_backward")
async def forward_backward(
    request: Request, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    """The SDK's protobuf ForwardBackwardRequest (service/tinker/wire.py); `forward_only` is `forward`.
    Checked whole before it is queued (service/tinker/checks.py)."""
    try:
        call = wire.read_forward_backward(await _proto_body(request))
    except wire.WireError as exc:
        raise BadRequest(f"body: {exc}", param="body") from exc
    checks.check_loss(call)
    checks.check_data(call)
    host = await _host_of(tinker, session, tenant.id, call.model_id)
    if call.loss_fn in PRIMITIVE_LOSS_PROVENANCE:
        run = await guard(tinker.model(tenant.id, call.model_id))
        ids = checks.sequence_ids(call.data)
        checks.attach_recorded(call.data, await guard(tinker.recorded(tenant.id, run["session_id"], ids)))
    args = {
        "model_id": call.model_id,
        "loss_fn": call.loss_fn,
        "config": call.loss_fn_config,
        "forward_only": call.forward_only,
        "data": [[d.tokens, d.inputs] for d in call.data],
    }
    request_id = await guard(tinker.send(host, "forward_backward", tenant.id, args, model_id=call.model_id))
    return _future(request_id, call.model_id)


@router.post("/optim_step")
async def optim_step(
    body: schemas.OptimStep, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    if body.adam_params is None:
        raise BadRequest("adam_params: only Adam is served", param="optimizer_params")
    host = await _host_of(tinker, session, tenant.id, body.model_id)
    args = {"model_id": body.model_id, "adam": body.adam_params.model_dump()}
    request_id = await guard(tinker.send(host, "optim_step", tenant.id, args, model_id=body.model_id))
    return _future(request_id, body.model_id)


def _name(path: str | None, param: str) -> str | None:
    if path is not None and (not path or "/" in path or len(path) > 128):
        raise BadRequest(f"{param}: a checkpoint name is 1 to 128 characters without '/'", param=param)
    return path


@router.post("/save_weights")
async def save_weights(
    body: schemas.SaveWeights, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    """save_state: the adapter's weights and optimizer state, as `tinker://<run>/weights/<name>`."""
    name = _name(body.path, "path")
    host = await _host_of(tinker, session, tenant.id, body.model_id)
    args = {"model_id": body.model_id, "name": name, "ttl_seconds": body.ttl_seconds}
    request_id = await guard(tinker.send(host, "save_weights", tenant.id, args, model_id=body.model_id))
    return _future(request_id, body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: schemas.SaveWeights, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    """The adapter's weights for sampling: named (`tinker://<run>/sampler_weights/<name>`), or unnamed
    with a sampling session made for them (`save_weights_and_get_sampling_client`)."""
    if body.kind != "snapshot":
        raise BadRequest("kind: only 'snapshot' sampling clients are served", param="kind")
    name = _name(body.path, "path")
    host = await _host_of(tinker, session, tenant.id, body.model_id)
    run = await guard(tinker.model(tenant.id, body.model_id))
    args: dict[str, Any] = {"model_id": body.model_id, "name": name, "ttl_seconds": body.ttl_seconds}
    if name is None:
        args["name"] = f"ephemeral-{body.sampling_session_seq_id or 0}-{body.seq_id or 0}"
        path = tinker_path(body.model_id, "sampler_weights", args["name"])
        args["sampling_session_id"] = await guard(
            tinker.create_sampling_session(
                tenant.id, session_id=run["session_id"], base_model=None, model_path=path, host=host
            )
        )
    request_id = await guard(
        tinker.send(host, "save_weights_for_sampler", tenant.id, args, model_id=body.model_id)
    )
    return _future(request_id, body.model_id)


@router.post("/load_weights")
async def load_weights(
    body: schemas.LoadWeights, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    """load_state into a client, or (with `session_id`) a new client made from a saved state. `path` is a
    Tinker path, a Tinker checkpoint's other names, or a job's checkpoint (service/tinker/sources.py)."""
    create = body.model_id is None and body.session_id is not None
    found = await sources.load_source(
        tinker, session, tenant.id, body.path, optimizer=body.optimizer, create=create
    )
    args: dict[str, Any] = {"path": body.path, "optimizer": body.optimizer, **found.args}
    if body.model_id is not None:
        run = await guard(tinker.model(tenant.id, body.model_id))
        if "job_checkpoint" in found.args and found.base_model != run["base_model"]:
            raise BadRequest(
                f"path: the checkpoint was trained on '{found.base_model}', this client on "
                f"'{run['base_model']}'",
                param="path",
            )
        host = await _host_of(tinker, session, tenant.id, body.model_id)
        args["model_id"] = body.model_id
    elif body.session_id is not None:
        base = body.base_model or found.base_model
        await run_in_threadpool(_check_base, session, tenant.id, base, "base_model")
        await _live_session(tinker, session, tenant.id, body.session_id)
        # None (a job's adapter, a state whose run is gone): a placeholder the host replaces with the
        # state's own LoRA shape before it answers (the SDK reads get_info after that)
        spec = found.spec or {"rank": sources.DEFAULT_RANK}
        model_id, host = await guard(
            tinker.register_model(
                tenant.id,
                session_id=body.session_id,
                model_seq_id=body.model_seq_id or 0,
                base_model=base,
                spec=spec,
                metadata=body.user_metadata or {},
            )
        )
        await _record_run(session, tenant.id, model_id, body.session_id, base, spec, body.user_metadata)
        args |= {"model_id": model_id, "base_model": base, "spec": spec, "create": True}
    else:
        raise BadRequest("model_id or session_id: one is required", param="model_id")
    request_id = await guard(tinker.send(host, "load_weights", tenant.id, args, model_id=args["model_id"]))
    return _future(request_id, args["model_id"])


# --- sampling ---------------------------------------------------------------------------------------------


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: schemas.CreateSamplingSession, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    if body.model_path is None and body.base_model is not None:
        await run_in_threadpool(_check_base, session, tenant.id, body.base_model, "base_model")
    await _live_session(tinker, session, tenant.id, body.session_id)
    sampling_session_id = await guard(
        tinker.create_sampling_session(
            tenant.id, session_id=body.session_id, base_model=body.base_model, model_path=body.model_path
        )
    )
    return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}


@router.get("/samplers/{sampling_session_id}")
async def sampler(sampling_session_id: str, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    found = await guard(tinker.sampling_session(tenant.id, sampling_session_id))
    return {
        "sampler_id": sampling_session_id,
        "base_model": found["base_model"],
        "model_path": found.get("model_path"),
    }


def _refuse_unserved(body: schemas.Sample) -> None:
    unserved = {
        "topk_sample_logprobs": body.topk_sample_logprobs,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k,
    }
    for param, asked in unserved.items():
        if asked:
            raise BadRequest(f"{param}: not served by this server", param=param, code="unsupported_parameter")
    if any(chunk.type != "encoded_text" for chunk in body.prompt.chunks):
        raise BadRequest("prompt.chunks: only encoded_text chunks are served", param="prompt.chunks")


@router.post("/asample")
async def asample(
    body: schemas.Sample, tenant: TenantDep, tinker: TinkerDep, settings: SettingsDep
) -> dict[str, Any]:
    _refuse_unserved(body)
    tokens = [t for chunk in body.prompt.chunks for t in chunk.tokens]
    if not tokens:
        raise BadRequest("prompt: at least one token", param="prompt")
    if body.sampling_session_id is not None:
        sampler = await guard(tinker.sampling_session(tenant.id, body.sampling_session_id))
    elif body.model_path is not None or body.base_model is not None:
        raise BadRequest(
            "sampling_session_id: sample through a sampling session", param="sampling_session_id"
        )
    else:
        raise BadRequest("sampling_session_id: required", param="sampling_session_id")
    max_tokens = body.sampling_params.max_tokens or settings.inference_default_max_tokens
    if max_tokens > settings.inference_max_tokens:
        raise BadRequest(
            f"sampling_params.max_tokens: at most {settings.inference_max_tokens} on this deployment",
            param="sampling_params.max_tokens",
        )
    context = await guard(tinker.context_of(sampler["base_model"]))
    if context is not None and len(tokens) + max_tokens > context:
        raise BadRequest(
            f"prompt: {len(tokens)} prompt tokens plus max_tokens {max_tokens} exceed the model's "
            f"context of {context} tokens",
            param="prompt",
            code="context_length_exceeded",
        )
    stop = body.sampling_params.stop
    args = {
        "base_model": sampler["base_model"],
        "model_path": sampler.get("model_path"),
        "prompt": tokens,
        "num_samples": body.num_samples,
        "max_tokens": max_tokens,
        "temperature": body.sampling_params.temperature,
        "top_p": body.sampling_params.top_p,
        "seed": body.sampling_params.seed,
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "prompt_logprobs": bool(body.prompt_logprobs) or body.topk_prompt_logprobs > 0,
        "topk_prompt_logprobs": body.topk_prompt_logprobs,
        "top_k": max(body.sampling_params.top_k, 0),
    }
    request_id = tinker.new_request_id()
    ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    if body.record_stability_info:  # stable_reinforce trains on these: the host records them
        args["record"] = {"session_id": sampler["session_id"], "sequence_ids": ids}
    await guard(
        tinker.send(
            sampler["host"], "sample", tenant.id, args, client=body.sampling_session_id, request_id=request_id
        )
    )
    return _future(request_id, sample_sequence_ids=ids)


# --- futures ----------------------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(body: schemas.RetrieveFuture, tenant: TenantDep, tinker: TinkerDep) -> Response:
    result: Result | None = await guard(tinker.retrieve(tenant.id, body.request_id))
    if result is None:
        return JSONResponse({"type": "try_again", "request_id": body.request_id, "queue_state": "active"})
    if result.kind == "proto":
        return Response(result.body, media_type="application/x-protobuf")
    if result.kind == "error":
        return JSONResponse({"error": result.body.decode(), "category": result.category})
    return Response(result.body, media_type="application/json")


# --- listings and checkpoints ----------------------------------------------------------------------------

MAX_PAGE = 1000


def _page(limit: int, offset: int) -> tuple[int, int]:
    return min(max(limit, 0), MAX_PAGE), max(offset, 0)


def _iso(seconds: str | float) -> str:
    return datetime.fromtimestamp(float(seconds), UTC).isoformat()


CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler"}  # the SDK's names of the kinds


def _checkpoint(row: TinkerCheckpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{row.kind}/{row.name}",
        "checkpoint_type": CHECKPOINT_TYPE[row.kind],
        "time": _iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.bytes,
        "expires_at": _iso(row.expires_at) if row.expires_at is not None else None,
    }


async def _run(tinker: Tinker, session: Session, tenant_id: str, run: TinkerRun) -> dict[str, Any]:
    saved = await _db(session, run_checkpoints, tenant_id=tenant_id, run_id=run.id)
    last = {kind: next((c for c in reversed(saved) if c.kind == kind), None) for kind in CHECKPOINT_TYPE}
    live = await guard(tinker.counters(run.id))
    return {
        "training_run_id": run.id,
        "base_model": run.base_model,
        "model_owner": tenant_id,
        "is_lora": True,
        "lora_rank": run.spec["rank"],
        "last_request_time": _iso(live.get("last_request", run.created_at)),
        "last_checkpoint": _checkpoint(last["weights"]) if last["weights"] else None,
        "last_sampler_checkpoint": _checkpoint(last["sampler_weights"]) if last["sampler_weights"] else None,
        "user_metadata": {k: str(v) for k, v in run.user_metadata.items()},
        # tunehouse's own, for the dashboard (the SDK ignores fields it does not know): the calls sent
        # for this run, its optim_steps, and the loss:sum of its last forward / forward_backward, which
        # live in Redis (zero again after Redis lost them)
        "calls": int(live.get("calls", 0)),
        "steps": int(live.get("steps", 0)),
        "last_loss": float(live["last_loss"]) if "last_loss" in live else None,
        "created_time": _iso(run.created_at),
    }


@router.get("/training_runs")
async def training_runs(
    tenant: TenantDep, tinker: TinkerDep, session: SessionDep, limit: int = 20, offset: int = 0
) -> dict[str, Any]:
    limit, offset = _page(limit, offset)
    page, total = await _db(session, runs.list_runs, tenant_id=tenant.id, limit=limit, offset=offset)
    return {
        "training_runs": [await _run(tinker, session, tenant.id, run) for run in page],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.get("/training_runs/{model_id}")
async def training_run(
    model_id: str, tenant: TenantDep, tinker: TinkerDep, session: SessionDep
) -> dict[str, Any]:
    run = await _db(session, runs.find_run, tenant_id=tenant.id, run_id=model_id)
    return await _run(tinker, session, tenant.id, run)


@router.get("/training_runs/{model_id}/checkpoints")
async def checkpoints(model_id: str, tenant: TenantDep, session: SessionDep) -> dict[str, Any]:
    await _db(session, runs.find_run, tenant_id=tenant.id, run_id=model_id)
    rows = await _db(session, run_checkpoints, tenant_id=tenant.id, run_id=model_id)
    return {"checkpoints": [_checkpoint(row) for row in rows], "cursor": None}


@router.get("/checkpoints")
async def user_checkpoints(
    tenant: TenantDep, session: SessionDep, limit: int = 100, offset: int = 0
) -> dict[str, Any]:
    """`RestClient.list_user_checkpoints`: the tenant's checkpoints across its runs, newest first."""
    limit, offset = _page(limit, offset)
    rows, total = await _db(session, tenant_checkpoints, tenant_id=tenant.id, limit=limit, offset=offset)
    return {
        "checkpoints": [_checkpoint(row) for row in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


def _find_checkpoint(session: Session, *, tenant_id: str, path: str, param: str) -> TinkerCheckpoint:
    TinkerPath.parse(path, param=param)
    row = find_tinker_checkpoint(session, tenant_id=tenant_id, name=path)
    if row is None:
        raise NotFound(f"{param}: no checkpoint '{path}'", param=param, code="checkpoint_not_found")
    return row


def _checkpoint_path(model_id: str, checkpoint_id: str) -> str:
    kind, _, name = checkpoint_id.partition("/")
    return tinker_path(model_id, kind, name)


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(
    model_id: str, kind: str, name: str, tenant: TenantDep, session: SessionDep
) -> None:
    """The checkpoint goes from the listings, from /v1/models and from the blob store."""
    path = _checkpoint_path(model_id, f"{kind}/{name}")
    row = await _db(session, _find_checkpoint, tenant_id=tenant.id, path=path, param="checkpoint_id")
    blob_keys = await _db(session, forget_tinker_checkpoint, row=row)
    await run_in_threadpool(_delete_blobs, blob_keys)


def _delete_blobs(keys: list[str]) -> None:
    blobs = get_blob_store()
    for blob_key in keys:
        blobs.delete(blob_key)


@router.put("/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
async def checkpoint_ttl(
    model_id: str, kind: str, name: str, body: schemas.CheckpointTtl, tenant: TenantDep, session: SessionDep
) -> None:
    """Expire the checkpoint `ttl_seconds` from now (None: never); the reaper deletes it then."""
    path = _checkpoint_path(model_id, f"{kind}/{name}")
    row = await _db(session, _find_checkpoint, tenant_id=tenant.id, path=path, param="checkpoint_id")
    await _db(session, set_tinker_checkpoint_ttl, row=row, ttl_seconds=body.ttl_seconds)


@router.post("/weights_info")
async def weights_info(body: schemas.WeightsInfo, tenant: TenantDep, session: SessionDep) -> dict[str, Any]:
    """What loading a checkpoint needs (`RestClient.get_weights_info_by_tinker_path`): its base, its LoRA."""
    row = await _db(
        session, _find_checkpoint, tenant_id=tenant.id, path=body.tinker_path, param="tinker_path"
    )
    run = await _db(
        session, runs.find_run, tenant_id=tenant.id, run_id=row.training_run_id, param="tinker_path"
    )
    return {
        "base_model": row.base_model,
        "is_lora": True,
        "lora_rank": run.spec["rank"],
        "train_unembed": run.spec.get("train_unembed", True),
        "train_mlp": run.spec.get("train_mlp", True),
        "train_attn": run.spec.get("train_attn", True),
    }


# --- not served -------------------------------------------------------------------------------------------

# (method, path, what it is): each answers 400 `tinker_unsupported` naming itself, which the SDK raises as
# a BadRequestError (a 501 would be retried by the SDK as a server error, for minutes)
UNSUPPORTED = [
    ("POST", "/create_custom_loss", "custom loss graphs (forward_backward_custom runs them client-side)"),
    ("POST", "/auth/token", "JWT exchange (send tml- + a tunehouse API key)"),
    ("GET", "/auth/apikey/me", "API key introspection (tunehouse keys: `tunehouse keys`)"),
    ("DELETE", "/auth/apikey/me", "API key deletion (tunehouse keys: `tunehouse keys revoke`)"),
    ("GET", "/billing/usage/events", "billing"),
    ("GET", "/billing/usage/checkpoints/current", "billing"),
    ("GET", "/audit", "audit logs"),
    ("POST", "/training_runs/{model_id}/checkpoints/{kind}/{name}/publish", "publishing checkpoints"),
    ("DELETE", "/training_runs/{model_id}/checkpoints/{kind}/{name}/publish", "publishing checkpoints"),
    ("POST", "/save_weights_external", "external weights (download a checkpoint with /v1/models instead)"),
    ("GET", "/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls", "external weights"),
    ("POST", "/copy_weights", "copying weights between accounts"),
    ("POST", "/join_sampling_session", "joining sampling sessions"),
    ("POST", "/retrieve_futures", "session-wide future polling"),
    ("POST", "/cancel_future", "cancelling futures"),
    ("POST", "/sessions/search", "session search"),
    ("PUT", "/sessions/{session_id}/project", "projects"),
    ("GET", "/sessions/{session_id}/trace_export", "trace export"),
]


def _unsupported(what: str) -> Any:
    async def refuse(_tenant: TenantDep) -> None:
        raise BadRequest(
            f"{what} is not supported by tunehouse's Tinker API (see docs/tinker.md)",
            code="tinker_unsupported",
        )

    return refuse


for _method, _path, _what in UNSUPPORTED:
    router.add_api_route(_path, _unsupported(_what), methods=[_method], responses=error_responses(400))
