"""The Tinker training-primitives API under the paths the official `tinker` SDK calls (`/api/v1/...`).

Auth: the SDK sends its key as `X-API-Key` and insists that it begins with `tml-`; a tunehouse key
`th-...` is given as `tml-th-...` (the prefix is dropped here), and every object is the key's tenant's.
Calls that compute (create_model, forward_backward, optim_step, save/load, sample) answer a future at
once (`{request_id}`); `retrieve_future` answers its result, `try_again`, or the failed-request shape
(`{error, category}`) that the SDK raises as `RequestFailedError`. Coverage: docs/tinker.md.
"""

from __future__ import annotations

import json
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
from service.base_models.tinker_checkpoints import tinker_path
from service.base_models.weights import find_model_weights
from service.config import get_settings
from service.dependencies import SessionDep, SettingsDep
from service.errors import BadRequest, Unauthorized, error_responses
from service.models import Tenant
from service.tinker import schemas, sources, wire
from service.tinker.channel import Result
from service.tinker.service import Tinker, guard
from trainers.formats import PRIMITIVE_LOSS_INPUTS

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
    url = get_settings().redis_url
    if url not in _clients:
        _clients[url] = Tinker(url)
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


@router.post("/create_session")
async def create_session(body: schemas.CreateSession, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    session_id = await guard(tinker.create_session(tenant.id, body.user_metadata or {}))
    return {"type": "create_session", "session_id": session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(body: schemas.SessionRef, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    await guard(tinker.heartbeat(tenant.id, body.session_id))
    return {"type": "session_heartbeat"}


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
    args = {"model_id": model_id, "base_model": body.base_model, "spec": spec}
    request_id = await guard(tinker.send(host, "create_model", tenant.id, args, model_id=model_id))
    return _future(request_id, model_id)


@router.post("/get_info")
async def get_info(body: schemas.ModelRef, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    run = await guard(tinker.model(tenant.id, body.model_id))
    spec = json.loads(run["spec"])
    return {
        "type": "get_info",
        "model_id": body.model_id,
        "model_data": {"arch": "lora", "model_name": run["base_model"], "tokenizer_id": run["base_model"]},
        "is_lora": True,
        "lora_rank": spec["rank"],
        "model_name": run["base_model"],
    }


async def _proto_body(request: Request) -> bytes:
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise BadRequest(
            "Content-Encoding: compressed bodies are not read here; send them plain", param="body"
        )
    return await request.body()


@router.post("/forward_backward")
async def forward_backward(request: Request, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    """The SDK's protobuf ForwardBackwardRequest (service/tinker/wire.py); `forward_only` is `forward`."""
    try:
        call = wire.read_forward_backward(await _proto_body(request))
    except wire.WireError as exc:
        raise BadRequest(f"body: {exc}", param="body") from exc
    if call.loss_fn not in PRIMITIVE_LOSS_INPUTS:
        raise BadRequest(
            f"loss_fn: '{call.loss_fn}' is not served (built-in losses: {', '.join(PRIMITIVE_LOSS_INPUTS)}; "
            "custom losses are not supported)",
            param="loss_fn",
            code="unsupported_loss",
        )
    if not call.data:
        raise BadRequest("data: at least one datum", param="data")
    for index, datum in enumerate(call.data):
        for key in ("target_tokens", *PRIMITIVE_LOSS_INPUTS[call.loss_fn]):
            if len(datum.inputs.get(key, ())) != len(datum.tokens) or not datum.tokens:
                raise BadRequest(
                    f"data[{index}].loss_fn_inputs.{key}: {call.loss_fn} needs one value per input token",
                    param=f"data[{index}].loss_fn_inputs.{key}",
                )
    host = await guard(tinker.host_of(tenant.id, call.model_id))
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
async def optim_step(body: schemas.OptimStep, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    if body.adam_params is None:
        raise BadRequest("adam_params: only Adam is served", param="optimizer_params")
    host = await guard(tinker.host_of(tenant.id, body.model_id))
    args = {"model_id": body.model_id, "adam": body.adam_params.model_dump()}
    request_id = await guard(tinker.send(host, "optim_step", tenant.id, args, model_id=body.model_id))
    return _future(request_id, body.model_id)


def _name(path: str | None, param: str) -> str | None:
    if path is not None and (not path or "/" in path or len(path) > 128):
        raise BadRequest(f"{param}: a checkpoint name is 1 to 128 characters without '/'", param=param)
    return path


@router.post("/save_weights")
async def save_weights(body: schemas.SaveWeights, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    """save_state: the adapter's weights and optimizer state, as `tinker://<run>/weights/<name>`."""
    name = _name(body.path, "path")
    host = await guard(tinker.host_of(tenant.id, body.model_id))
    args = {"model_id": body.model_id, "name": name}
    request_id = await guard(tinker.send(host, "save_weights", tenant.id, args, model_id=body.model_id))
    return _future(request_id, body.model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: schemas.SaveWeights, tenant: TenantDep, tinker: TinkerDep
) -> dict[str, Any]:
    """The adapter's weights for sampling: named (`tinker://<run>/sampler_weights/<name>`), or unnamed
    with a sampling session made for them (`save_weights_and_get_sampling_client`)."""
    if body.kind != "snapshot":
        raise BadRequest("kind: only 'snapshot' sampling clients are served", param="kind")
    name = _name(body.path, "path")
    run = await guard(tinker.model(tenant.id, body.model_id))
    host = await guard(tinker.host_of(tenant.id, body.model_id))
    args: dict[str, Any] = {"model_id": body.model_id, "name": name}
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
        host = await guard(tinker.host_of(tenant.id, body.model_id))
        args["model_id"] = body.model_id
    elif body.session_id is not None:
        base = body.base_model or found.base_model
        await run_in_threadpool(_check_base, session, tenant.id, base, "base_model")
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
        "topk_prompt_logprobs": body.topk_prompt_logprobs,
        "topk_sample_logprobs": body.topk_sample_logprobs,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k,
        "sampling_params.top_k": body.sampling_params.top_k > 0,
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
        "prompt_logprobs": bool(body.prompt_logprobs),
    }
    request_id = await guard(tinker.send(sampler["host"], "sample", tenant.id, args))
    ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
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


# --- listings ---------------------------------------------------------------------------------------------


def _iso(seconds: str | float) -> str:
    return datetime.fromtimestamp(float(seconds), UTC).isoformat()


def _checkpoint(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{entry['kind']}/{entry['name']}",
        "checkpoint_type": "training" if entry["kind"] == "weights" else "sampler",
        "time": _iso(entry["time"]),
        "tinker_path": entry["path"],
        "size_bytes": entry.get("size_bytes"),
    }


async def _run(tinker: Tinker, tenant_id: str, run: dict[str, str], model_id: str) -> dict[str, Any]:
    spec = json.loads(run["spec"])
    checkpoints = await tinker.checkpoints(tenant_id, model_id)
    last = {
        kind: next((c for c in reversed(checkpoints) if c["kind"] == kind), None)
        for kind in ("weights", "sampler_weights")
    }
    return {
        "training_run_id": model_id,
        "base_model": run["base_model"],
        "model_owner": tenant_id,
        "is_lora": True,
        "lora_rank": spec["rank"],
        "last_request_time": _iso(run["last_request"]),
        "last_checkpoint": _checkpoint(last["weights"]) if last["weights"] else None,
        "last_sampler_checkpoint": _checkpoint(last["sampler_weights"]) if last["sampler_weights"] else None,
        "user_metadata": {k: str(v) for k, v in json.loads(run.get("metadata", "{}")).items()},
        # tunehouse's own, for the dashboard (the SDK ignores fields it does not know): the calls sent
        # for this run, its optim_steps, and the loss:sum of its last forward / forward_backward
        "calls": int(run.get("calls", 0)),
        "steps": int(run.get("steps", 0)),
        "last_loss": float(run["last_loss"]) if "last_loss" in run else None,
        "created_time": _iso(run["created"]),
    }


@router.get("/training_runs")
async def training_runs(
    tenant: TenantDep, tinker: TinkerDep, limit: int = 20, offset: int = 0
) -> dict[str, Any]:
    runs = await guard(tinker.runs(tenant.id))
    page = runs[offset : offset + max(limit, 0)]
    return {
        "training_runs": [await guard(_run(tinker, tenant.id, run, run["id"])) for run in page],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
    }


@router.get("/training_runs/{model_id}")
async def training_run(model_id: str, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    run = await guard(tinker.model(tenant.id, model_id))
    described: dict[str, Any] = await guard(_run(tinker, tenant.id, run, model_id))
    return described


@router.get("/training_runs/{model_id}/checkpoints")
async def checkpoints(model_id: str, tenant: TenantDep, tinker: TinkerDep) -> dict[str, Any]:
    entries = await guard(tinker.checkpoints(tenant.id, model_id))
    return {"checkpoints": [_checkpoint(e) for e in entries], "cursor": None}


# --- not served -------------------------------------------------------------------------------------------

# (method, path, what it is): each answers 400 `tinker_unsupported` naming itself, which the SDK raises as
# a BadRequestError (a 501 would be retried by the SDK as a server error, for minutes)
UNSUPPORTED = [
    ("POST", "/create_custom_loss", "custom loss graphs (forward_backward_custom runs them client-side)"),
    ("POST", "/telemetry", "telemetry (set TINKER_TELEMETRY=0 in the client)"),
    ("POST", "/auth/token", "JWT exchange (send tml- + a tunehouse API key)"),
    ("GET", "/billing/usage/events", "billing"),
    ("GET", "/billing/usage/checkpoints/current", "billing"),
    ("GET", "/audit", "audit logs"),
    ("POST", "/training_runs/{model_id}/checkpoints/{kind}/{name}/publish", "publishing checkpoints"),
    ("DELETE", "/training_runs/{model_id}/checkpoints/{kind}/{name}/publish", "publishing checkpoints"),
    ("PUT", "/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl", "checkpoint TTLs"),
    ("POST", "/save_weights_external", "external weights"),
    ("GET", "/training_runs/{model_id}/checkpoints/{kind}/{name}/external_weights_urls", "external weights"),
    ("POST", "/copy_weights", "copying weights between accounts"),
    ("POST", "/join_sampling_session", "joining sampling sessions"),
    ("POST", "/retrieve_futures", "session-wide future polling"),
    ("POST", "/cancel_future", "cancelling futures"),
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
