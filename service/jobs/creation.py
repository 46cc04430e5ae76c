"""Create a fine-tuning job: check its model, integrations, resources, grader, files and
hyperparameters (each refusal a 4xx naming its parameter, nothing stored), then store it queued, with
its first events, and send its run message after the commit."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.base_models.catalog import resolve_base_model, unknown_model_message
from service.base_models.fine_tuned import find_final_checkpoint
from service.base_models.modalities import model_modalities
from service.base_models.tinker_checkpoints import find_tinker_checkpoint
from service.config import Settings
from service.errors import BadRequest, NotFound
from service.files.service import PURPOSES, get_file
from service.files.validation import method_formats
from service.graders.service import check_grader
from service.ids import new_id
from service.jobs.architecture import architecture_problem
from service.jobs.capacity import note_if_unfit
from service.jobs.dispatch import send_after_commit
from service.jobs.events import add_event, state_event
from service.jobs.integrations import duplicate_type, stored_integrations
from service.jobs.lifecycle import queued_values
from service.jobs.resources import ONE_GPU, Resources, queue_for
from service.jobs.spec import (
    JobCreate,
    Method,
    hyperparameter_problem,
    load_method,
    resolve_hyperparameters,
    resolved_values,
    resources_problem,
    stored_method,
)
from service.models import File, Job, Tenant
from trainers.formats import FileFormat
from trainers.modalities import IMAGE
from trainers.registry import METHODS, VISION


def _check_file(session: Session, *, tenant: Tenant, file_id: str, param: str, method_type: str) -> File:
    try:
        row = get_file(session, tenant=tenant, file_id=file_id, param=param)
    except NotFound as exc:
        raise BadRequest(f"{param}: no such file '{file_id}'", param=param, code="invalid_file") from exc
    if row.purpose not in PURPOSES:
        raise BadRequest(
            f"{param}: file '{file_id}' has purpose '{row.purpose}'; train on a file uploaded with "
            f"purpose {', '.join(PURPOSES)}",
            param=param,
            code="invalid_file",
        )
    accepted = method_formats(method_type)
    if FileFormat(row.format) not in accepted:
        names = ", ".join(sorted(f.value for f in accepted))
        raise BadRequest(
            f"{param}: file '{file_id}' has format '{row.format}', "
            f"but method '{method_type}' needs one of: {names}",
            param=param,
            code="invalid_file_format",
        )
    return row


def _check_images(
    session: Session,
    *,
    tenant: Tenant,
    spec: JobCreate,
    method: Method,
    files: list[tuple[str, File]],
    settings: Settings,
) -> None:
    """Rows with images train only on a model that takes them, with a method that does; a vision base
    trains unpacked, and the ``VISION`` knobs ask for a vision base (docs/vision.md)."""
    with_images = [(param, row) for param, row in files if row.images]
    hp = resolved_values(method)
    asked = [p.name for p in VISION if hp.get(p.name)]
    takes = model_modalities(session, settings, tenant_id=tenant.id, name=spec.model)
    # None: a hub model the API has not seen; its worker refuses images if the model takes none
    if takes is not None and IMAGE not in takes:
        if with_images:
            param, row = with_images[0]
            raise BadRequest(
                f"model '{spec.model}' takes text only, and {param} '{row.id}' has {row.images} images "
                f"in {row.image_examples} examples: train on a vision-language base (docs/vision.md)",
                param="model",
                code="model_takes_no_images",
            )
        if asked:
            knob = f"method.{method.type}.hyperparameters.{asked[0]}"
            raise BadRequest(
                f"{knob}: model '{spec.model}' takes text only; it has no vision tower or projector",
                param=knob,
                code="invalid_value",
            )
    if hp.get("packing") and (with_images or (takes is not None and IMAGE in takes)):
        knob = f"method.{method.type}.hyperparameters.packing"
        raise BadRequest(
            f"{knob}: packing is not supported on a vision-language base (its rows' image positions are "
            "per row); set packing to false",
            param=knob,
            code="invalid_value",
        )
    if with_images and not method.declaration.images:
        param, row = with_images[0]
        takes_them = ", ".join(sorted(m.name for m in METHODS.values() if m.images))
        raise BadRequest(
            f"method '{method.type}' does not train on images ({param} '{row.id}' has {row.images}); "
            f"the methods that do: {takes_them}",
            param="method.type",
            code="invalid_value",
        )


def _check_rl(
    session: Session, *, tenant: Tenant, method: Method, spec: JobCreate, settings: Settings
) -> None:
    grader = method.grader
    if grader is None:
        return
    param = f"method.{method.type}.grader"
    check_grader(session, tenant=tenant, grader=grader, settings=settings, param=param)


def _method_of(spec: JobCreate) -> Method:
    if spec.method is not None and spec.hyperparameters is not None:
        raise BadRequest(
            "give hyperparameters inside 'method', not at the top level as well",
            param="hyperparameters",
            code="invalid_value",
        )
    if spec.method is not None:
        return spec.method
    legacy = spec.hyperparameters.model_dump() if spec.hyperparameters else {}
    return load_method({"type": "supervised", "supervised": {"hyperparameters": legacy}})


def _check_resources(resources: Resources, settings: Settings) -> None:
    """What the field's own bounds cannot say: one spelling of the GPUs per node, the operator's most
    nodes, and a Ray cluster to run several nodes on (a 400 naming the field)."""
    if resources.gpus is not None and resources.gpus_per_node is not None:
        raise BadRequest(
            "resources: give gpus_per_node or gpus (its one-node name), not both",
            param="resources.gpus",
            code="invalid_value",
        )
    if not resources.multi_node:
        return
    if not settings.ray_address:
        raise BadRequest(
            f"resources.nodes: {resources.nodes} nodes need a Ray cluster, and this deployment has none "
            "(TUNEHOUSE_RAY_ADDRESS); ask for nodes: 1",
            param="resources.nodes",
            code="multi_node_unavailable",
        )
    if resources.nodes > settings.max_nodes:
        raise BadRequest(
            f"resources.nodes: {resources.nodes} is above this deployment's maximum of {settings.max_nodes}",
            param="resources.nodes",
            code="invalid_value",
        )


@dataclass(frozen=True)
class CheckedSpec:
    """A creation body that passed every check: its method with "auto" resolved, its resources and its
    training file's row."""

    method: Method
    resources: Resources
    training: File


def check_spec(session: Session, *, tenant: Tenant, spec: JobCreate, settings: Settings) -> CheckedSpec:
    """Every check a job creation makes, storing nothing (creation and the pre-flight estimate,
    service/jobs/estimate.py, both call it): a refusal is a 4xx naming its parameter."""
    # a job's final model, or a Tinker checkpoint (its adapter merged into its base for the job)
    is_fine_tuned = spec.model.startswith("ft:") and (
        find_final_checkpoint(session, tenant_id=tenant.id, name=spec.model) is not None
        or find_tinker_checkpoint(session, tenant_id=tenant.id, name=spec.model) is not None
    )
    deleted = spec.model.startswith("ft:") and not is_fine_tuned
    if deleted and find_final_checkpoint(session, tenant_id=tenant.id, name=spec.model, include_deleted=True):
        raise NotFound(
            f"model '{spec.model}' was deleted (DELETE /v1/models) and cannot be fine-tuned further",
            param="model",
            code="model_not_found",
        )
    if not is_fine_tuned and resolve_base_model(settings, spec.model, session) is None:
        raise BadRequest(
            unknown_model_message(settings, spec.model, session),
            param="model",
            code="model_not_available",
        )
    if spec.integrations and (i := duplicate_type(spec.integrations)) is not None:
        raise BadRequest(
            f"integrations[{i}]: a second '{spec.integrations[i].type}' integration (one of each type)",
            param=f"integrations[{i}].type",
            code="invalid_value",
        )
    method = _method_of(spec)
    resources = spec.resources or ONE_GPU
    _check_resources(resources, settings)
    _check_rl(session, tenant=tenant, method=method, spec=spec, settings=settings)
    training = _check_file(
        session, tenant=tenant, file_id=spec.training_file, param="training_file", method_type=method.type
    )
    files = [("training_file", training)]
    if spec.validation_file is not None:
        validation = _check_file(
            session,
            tenant=tenant,
            file_id=spec.validation_file,
            param="validation_file",
            method_type=method.type,
        )
        files.append(("validation_file", validation))

    resolve_hyperparameters(method, n_examples=training.line_count)
    problem = (
        hyperparameter_problem(method)
        or resources_problem(method, resources)
        or architecture_problem(
            session, tenant_id=tenant.id, settings=settings, model=spec.model, method=method
        )
    )
    if problem is not None:
        param, message = problem
        raise BadRequest(f"{param}: {message}", param=param, code="invalid_value")
    _check_images(session, tenant=tenant, spec=spec, method=method, files=files, settings=settings)
    return CheckedSpec(method, resources, training)


def create_job(session: Session, *, tenant: Tenant, spec: JobCreate, settings: Settings) -> Job:
    checked = check_spec(session, tenant=tenant, spec=spec, settings=settings)
    method, resources = checked.method, checked.resources
    job = Job(
        id=new_id("ftjob"),
        tenant_id=tenant.id,
        model=spec.model,
        training_file=spec.training_file,
        validation_file=spec.validation_file,
        method=stored_method(method),
        suffix=spec.suffix,
        seed=spec.seed if spec.seed is not None else secrets.randbelow(2**31),
        user_metadata=spec.metadata,
        integrations=stored_integrations(spec.integrations),
        status="validating_files",
        resources=resources.stored(),
        queue=queue_for(settings.job_queue, resources),
    )
    session.add(job)
    session.flush()
    add_event(session, job.id, f"Validating training file: {spec.training_file}")
    # files are validated line by line at upload, so the job can move on at once
    t = time.time()
    for name, value in queued_values(t).items():
        setattr(job, name, value)
    add_event(session, job.id, "Files validated, moving job to queued state", data=state_event("queued"))
    note_if_unfit(session, job, base_queue=settings.job_queue, within=settings.lease_timeout_seconds)
    # sent after commit; if the broker is down the job stays queued and the reconciler sends it later
    send_after_commit(session, job.id, t, queue=job.queue)
    return job
