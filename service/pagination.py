"""Cursor pagination in OpenAI's shape: `after=<id>`, `limit`, `{"object": "list", "has_more"}`.

Ids are time-ordered (service/ids.py), so "after X" in newest-first order is simply `id < X`.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import InstrumentedAttribute, Session

from service.errors import BadRequest

T = TypeVar("T")

MAX_LIMIT = 10_000  # a page's largest `limit` (the routes' query parameter: service.dependencies.Limit)


def check_limit(limit: int, *, maximum: int = MAX_LIMIT) -> int:
    if not 1 <= limit <= maximum:
        raise BadRequest(f"limit must be between 1 and {maximum}", param="limit", code="invalid_value")
    return limit


def page(
    session: Session,
    stmt: Select[T],
    key: InstrumentedAttribute[Any],
    *,
    after: Any | None,
    limit: int,
    order: Literal["asc", "desc"] = "desc",
) -> tuple[list[T], bool]:
    """Rows after the cursor in the given order, and whether more exist."""
    check_limit(limit)
    if after is not None:
        stmt = stmt.where(key < after if order == "desc" else key > after)
    stmt = stmt.order_by(key.desc() if order == "desc" else key.asc()).limit(limit + 1)
    rows = list(session.scalars(stmt))
    return rows[:limit], len(rows) > limit


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
