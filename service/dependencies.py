"""Request-scoped dependencies as `Annotated` aliases."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from service.config import Settings, get_settings
from service.db import session_scope


def _session() -> Iterator[Session]:
    # Commit after the route function returns but before the response is sent (scope="function"),
    # so a client never sees 200 for something that was not stored. Tasks queued during the request
    # are sent by service.queue only after this commit, and dropped on rollback.
    with session_scope() as session:
        yield session


SessionDep = Annotated[Session, Depends(_session, scope="function")]
SettingsDep = Annotated[Settings, Depends(get_settings)]
