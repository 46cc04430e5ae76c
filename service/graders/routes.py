"""HTTP routes for /v1/fine_tuning/alpha/graders: test a grader before paying for an RL job."""

from __future__ import annotations

from fastapi import APIRouter

from service.auth import TenantDep
from service.dependencies import SessionDep, SettingsDep
from service.errors import error_responses
from service.graders import service
from service.graders.schemas import (
    GraderRunRequest,
    GraderRunResponse,
    GraderValidateRequest,
    GraderValidateResponse,
)

router = APIRouter(
    prefix="/v1/fine_tuning/alpha/graders", tags=["graders"], responses=error_responses(400, 401, 503)
)


@router.post("/validate", response_model=GraderValidateResponse)
def validate_grader(
    body: GraderValidateRequest, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> GraderValidateResponse:
    """The grader as it will be used (defaults filled in), or a 400 naming the field at fault."""
    service.check_grader(session, tenant=tenant, grader=body.grader, settings=settings, param="grader")
    return GraderValidateResponse(grader=body.grader.model_dump(mode="json"))


@router.post("/run", response_model=GraderRunResponse, responses=error_responses(501))
def run_grader(
    body: GraderRunRequest, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> GraderRunResponse:
    """Score one `model_sample` for one `item`; a `multi` grader's sub-scores are in `sub_rewards`."""
    service.check_grader(session, tenant=tenant, grader=body.grader, settings=settings, param="grader")
    return service.run_grader(
        body.grader, model_sample=body.model_sample, item=body.item or {}, settings=settings
    )
