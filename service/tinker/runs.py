"""The durable half of Tinker's state, in PostgreSQL: sessions and training runs (what each is and whose).
The transient half stays in Redis (service/tinker/service.py): which host holds a run's adapter, its
live counters, sampling sessions, queued calls and their results. A Redis or API restart therefore
loses no run nor session: they still list, and their saved states still load into new clients (a run
whose host is unknown answers 410 for calls that compute, as after a host's death).

Plain functions on a SQLAlchemy session; the routes call them in a thread and commit.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.ids import now
from service.models import TinkerRun, TinkerSession


def record_session(session: Session, *, tenant_id: str, session_id: str, metadata: dict[str, Any]) -> None:
    session.add(TinkerSession(id=session_id, tenant_id=tenant_id, user_metadata=metadata))


def find_session(session: Session, *, tenant_id: str, session_id: str) -> TinkerSession:
    row = session.get(TinkerSession, session_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"No session '{session_id}'", param="session_id", code="session_not_found")
    return row


def finish_session(session: Session, *, tenant_id: str, session_id: str, reason: str) -> None:
    """The first reason stays (`ServiceClient.close` is first-wins, as in Tinker)."""
    find_session(session, tenant_id=tenant_id, session_id=session_id)
    session.execute(
        update(TinkerSession)
        .where(TinkerSession.id == session_id, TinkerSession.finish_reason.is_(None))
        .values(finish_reason=reason, finished_at=now())
    )


def list_sessions(session: Session, *, tenant_id: str, limit: int, offset: int) -> list[str]:
    stmt = (
        select(TinkerSession.id)
        .where(TinkerSession.tenant_id == tenant_id)
        .order_by(TinkerSession.created_at.desc(), TinkerSession.id.desc())
        .offset(offset)
        .limit(limit)
    )
    return list(session.execute(stmt).scalars())


def record_run(
    session: Session,
    *,
    tenant_id: str,
    run_id: str,
    session_id: str,
    base_model: str,
    spec: dict[str, Any],
    metadata: dict[str, Any],
) -> None:
    session.add(
        TinkerRun(
            id=run_id,
            tenant_id=tenant_id,
            session_id=session_id,
            base_model=base_model,
            spec=spec,
            user_metadata=metadata,
        )
    )


def set_run_spec(session: Session, *, run_id: str, spec: dict[str, Any]) -> None:
    """A run made from a saved state takes the state's LoRA shape once the host has read it."""
    session.execute(update(TinkerRun).where(TinkerRun.id == run_id).values(spec=spec))


def find_run(session: Session, *, tenant_id: str, run_id: str, param: str = "model_id") -> TinkerRun:
    row = session.get(TinkerRun, run_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"No training run '{run_id}'", param=param, code="model_not_found")
    return row


def list_runs(session: Session, *, tenant_id: str, limit: int, offset: int) -> tuple[list[TinkerRun], int]:
    """A page of the tenant's runs, newest first, and how many there are."""
    where = TinkerRun.tenant_id == tenant_id
    stmt = select(TinkerRun).where(where).order_by(TinkerRun.created_at.desc(), TinkerRun.id.desc())
    rows = list(session.execute(stmt.offset(offset).limit(limit)).scalars())
    total = session.execute(select(func.count()).select_from(TinkerRun).where(where)).scalar_one()
    return rows, int(total)


def session_runs(session: Session, *, tenant_id: str, session_id: str) -> list[str]:
    stmt = (
        select(TinkerRun.id)
        .where(TinkerRun.tenant_id == tenant_id, TinkerRun.session_id == session_id)
        .order_by(TinkerRun.created_at, TinkerRun.id)
    )
    return list(session.execute(stmt).scalars())
