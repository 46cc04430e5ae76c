"""`Idempotency-Key` on job creation: a retried `POST /v1/fine_tuning/jobs` returns the first job.

A client that timed out cannot know whether its job was stored (a hung broker once held the answer
41 s while the job was committed and later ran: issue 46), so it retries; the SDK sends one key per
logical call and reuses it on each retry. Keys are scoped to the tenant and stored with the job in
the same transaction, so a key names a job only if that job exists:
- same key, same spec: the first job, answered 200 as if created now (nothing is created or sent);
- same key, another spec: 409 naming the header (the key was reused for a different request);
- two requests with one key at once: the second waits on the first's row (the primary key), then
  finds its job and answers with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from pydantic import BaseModel
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import Conflict
from service.jobs import repository
from service.models import IdempotencyKey, Job, Tenant

HEADER = "Idempotency-Key"
# Stripe's and the IETF draft's bound; the openai clients' keys (`stainless-python-retry-<uuid4>`)
# and a UUID fit with room to spare
MAX_KEY_CHARS = 255


def request_hash(spec: BaseModel) -> str:
    """The spec as parsed, canonically: the same request sent twice hashes alike whatever its key order
    or whitespace."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _replay(session: Session, *, tenant: Tenant, key: str, digest: str) -> Job | None:
    row = session.get(IdempotencyKey, (tenant.id, key))
    if row is None:
        return None
    if row.request_hash != digest:
        raise Conflict(
            f"{HEADER} '{key[:64]}' was already used for a different request (job {row.job_id}); "
            "send a new key for a new job",
            param=HEADER,
            code="idempotency_key_reused",
        )
    job = repository.tenant_job(session, tenant_id=tenant.id, job_id=row.job_id)
    assert job is not None  # the key's row references its job
    return job


def create_once(
    session: Session, *, tenant: Tenant, key: str | None, spec: BaseModel, create: Callable[[], Job]
) -> Job:
    """`create()`'s job, or the job an earlier request with the same `key` created."""
    if key is None:
        return create()
    digest = request_hash(spec)
    earlier = _replay(session, tenant=tenant, key=key, digest=digest)
    if earlier is not None:
        return earlier
    job = create()
    # A plain flush, not a savepoint: SQLAlchemy runs `after_commit` hooks when a savepoint is
    # released too, which would send the job's run message before the job is committed.
    session.add(IdempotencyKey(tenant_id=tenant.id, key=key, request_hash=digest, job_id=job.id))
    try:
        session.flush()
    except IntegrityError:
        # a concurrent request with this key committed first: drop this job (and its run message,
        # parked until commit: service/queue.py) and answer with that one
        session.rollback()
        earlier = _replay(session, tenant=tenant, key=key, digest=digest)
        if earlier is None:  # the other request's job is gone already: not ours to explain
            raise
        return earlier
    return job
