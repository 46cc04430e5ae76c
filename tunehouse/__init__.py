"""tunehouse: the Python SDK and CLI of the tunehouse training service.

Imports neither torch nor fastapi: the server-side commands of the CLI import them lazily.
"""

from tunehouse._client import AsyncClient, Client
from tunehouse._exceptions import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    TunehouseError,
    UnprocessableEntityError,
)
from tunehouse.resources.jobs import WaitTimeout
from tunehouse.types import (
    Checkpoint,
    FileObject,
    FineTuningJob,
    JobEvent,
    MetricRow,
    StreamEnd,
    StreamItem,
    WebhookDelivery,
    WebhookEndpoint,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Checkpoint",
    "Client",
    "ConflictError",
    "FileObject",
    "FineTuningJob",
    "InternalServerError",
    "JobEvent",
    "MetricRow",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "StreamEnd",
    "StreamItem",
    "TunehouseError",
    "UnprocessableEntityError",
    "WaitTimeout",
    "WebhookDelivery",
    "WebhookEndpoint",
]
