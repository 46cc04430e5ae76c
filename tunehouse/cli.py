"""The `tunehouse` command. Server-side commands import the service lazily, so the SDK side of this
package never pulls in FastAPI or torch at import time.

    tunehouse up [--host H] [--port P] [--data-dir D] [--no-demo] [--no-tinker]   the embedded default
    tunehouse worker [--data-dir D] [--inference | --tinker]        a training (inference, Tinker) worker
    tunehouse migrate                                               alembic upgrade head
    tunehouse keys create --tenant NAME [--expires-in 30d] [--json] a new API key (last line, or JSON)
    tunehouse keys list [--tenant NAME] [--json]                    keys (id, prefix, status), no secrets
    tunehouse keys revoke KEY                                       by id (key-...), prefix (th-...) or key
    tunehouse files upload|list|get|delete ...                      training files
    tunehouse jobs estimate|create|list|get|cancel|pause|resume|events|metrics|wait ...
    tunehouse checkpoints list|download ...
    tunehouse models list                                           base models (what each is) and yours
    tunehouse models add HUB_ID|PATH [--name N] [--revision R]      a base model into the catalogue
    tunehouse chat MODEL [MESSAGE]                                  ask a model; the reply streams

Client commands take --base-url / --api-key (or TUNEHOUSE_BASE_URL / TUNEHOUSE_API_KEY) and --json.
User errors print one line and exit non-zero; `jobs wait` exits 0 only when the job succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

# the extra that brings a missing top-level module: a client-only install (`pip install tunehouse`) has
# httpx and pydantic alone, and the server-side commands say what to install instead of a traceback
_SERVER_MODULES = frozenset(
    [
        "fastapi",
        "uvicorn",
        "sqlalchemy",
        "alembic",
        "psycopg",
        "pydantic_settings",
        "celery",
        "kombu",
        "redis",
        "boto3",
        "huggingface_hub",
        "multipart",
    ]
)
_TRAIN_MODULES = frozenset(("torch", "transformers", "peft", "accelerate", "safetensors", "tokenizers"))


def missing_extra(module: str) -> str | None:
    """The extra that installs `module` (a dotted name's top package), or None if it is not ours.

    >>> missing_extra("sqlalchemy.orm"), missing_extra("torch"), missing_extra("numpyx")
    ('server', 'train', None)
    """
    top = module.split(".")[0]
    if top in _SERVER_MODULES:
        return "server"
    return "train" if top in _TRAIN_MODULES else None


class UserError(Exception):
    """Printed as one line, no traceback."""


def _use_data_dir(data_dir: str | None) -> None:
    # settings are read once per process, from the environment: set it before anything imports them
    if data_dir:
        os.environ["TUNEHOUSE_DATA_DIR"] = os.path.abspath(data_dir)


def cmd_migrate(_args: argparse.Namespace) -> int:
    from service.config import get_settings
    from service.migrate import upgrade_head

    upgrade_head(get_settings().database_url)
    print("database is at the newest schema")
    return 0


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """Seconds in `90`, `90s`, `15m`, `12h` or `30d`.

    >>> parse_duration("30d"), parse_duration("15m"), parse_duration("90")
    (2592000, 900, 90)
    """
    raw = text.strip().lower()
    unit = raw[-1] if raw and raw[-1] in _DURATION_UNITS else "s"
    number = raw[:-1] if raw and raw[-1] in _DURATION_UNITS else raw
    if not number.isdigit() or not 0 < int(number) * _DURATION_UNITS[unit] <= 100 * 365 * 86400:
        raise UserError(f"--expires-in: '{text}' is not a duration such as 3600, 90m, 12h or 30d")
    return int(number) * _DURATION_UNITS[unit]


def _migrated() -> None:
    from service.config import get_settings
    from service.migrate import upgrade_head

    upgrade_head(get_settings().database_url)


def _when(ts: int | None) -> str:
    import datetime

    return "-" if ts is None else datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%d %H:%M")


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service.auth import create_api_key
    from service.db import session_scope

    if not args.tenant.strip():
        raise UserError("--tenant must not be empty")
    expires_in = parse_duration(args.expires_in) if args.expires_in else None
    _migrated()
    with session_scope() as session:
        tenant, key = create_api_key(
            session, tenant_name=args.tenant.strip(), key_name=args.name or "", expires_in_seconds=expires_in
        )
        tenant_id = tenant.id
    if args.json:
        print(json.dumps({"tenant": args.tenant, "tenant_id": tenant_id, "api_key": key}))
    else:
        print(f"created an API key for tenant '{args.tenant}' ({tenant_id}); it is shown only once:")
        print(key)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from service.auth import list_api_keys
    from service.db import session_scope

    _migrated()
    with session_scope() as session:
        keys = list_api_keys(session, tenant_name=args.tenant)
    if args.json:
        print(json.dumps([{**asdict(k), "status": k.status} for k in keys]))
        return 0
    print(f"{'ID':<32} {'PREFIX':<20} {'TENANT':<20} {'STATUS':<8} {'CREATED':<16} {'EXPIRES':<16} NAME")
    for k in keys:
        print(
            f"{k.id:<32} {k.prefix:<20} {k.tenant:<20} {k.status:<8} "
            f"{_when(k.created_at):<16} {_when(k.expires_at):<16} {k.name}"
        )
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from service.auth import revoke_api_key
    from service.db import session_scope
    from service.errors import NotFound

    _migrated()
    try:
        with session_scope() as session:
            row = revoke_api_key(session, key=args.key.strip())
            key_id = row.id
    except NotFound as exc:
        raise UserError(exc.message) from exc
    # servers read the key row on every request: the key is refused from their next request on
    print(f"revoked {key_id}")
    return 0


def cmd_models_add(args: argparse.Namespace) -> int:
    from service.base_models.adding import AddError, add_base_model
    from service.db import session_scope
    from service.storage import get_blob_store

    _migrated()
    try:
        with session_scope() as session:
            row = add_base_model(
                session,
                get_blob_store(),
                args.source,
                name=args.name,
                revision=args.revision,
                token=args.token,
                say=(lambda _line: None) if args.json else print,
            )
            summary = {"id": row.id, "revision": row.revision, "files": len(row.files), "bytes": row.bytes}
    except AddError as exc:
        raise UserError(str(exc)) from exc
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"added {summary['id']} at revision {summary['revision']} ({summary['files']} files, "
            f"{summary['bytes']:,} bytes in the blob store); workers fetch it on first use"
        )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from service.config import get_settings

    if args.tinker:  # not a Celery worker: it reads its own Redis queues (service/tinker/channel.py)
        from worker.tinker_host import supervise  # the host in a child, started again if it dies

        supervise()
        return 0
    # an inference worker is its own process on its own queue: trying a model never waits behind the
    # training job a training worker is running (one request at a time; start more to serve more)
    if args.inference:
        from service.inference.task import INFERENCE_QUEUE
        from worker.inference_app import app

        queue, name = INFERENCE_QUEUE, "inference"
    else:
        from worker.celery_app import app
        from worker.launch import worker_queues

        # the queues of the job sizes its GPUs hold, which it claims jobs from too (fairness.py)
        queue, name = ",".join(worker_queues(get_settings())), "tunehouse"
    argv = [
        "worker",
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "-Q",
        queue,
        "--loglevel",
        args.loglevel,
        "--without-gossip",
        "--without-mingle",
        "-n",
        f"{name}-{os.getpid()}@%h",
    ]
    app.worker_main(argv)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from tunehouse.embedded import run_embedded

    return run_embedded(host=args.host, port=args.port, demo=not args.no_demo, tinker=not args.no_tinker)


def build_parser() -> argparse.ArgumentParser:
    from tunehouse.cli_client import add_client_commands, models_list

    parser = argparse.ArgumentParser(prog="tunehouse", description="OpenAI-compatible training service")
    parser.add_argument("--data-dir", help="state folder for the embedded default (TUNEHOUSE_DATA_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", help="API URL (TUNEHOUSE_BASE_URL; default http://127.0.0.1:8000)")
    common.add_argument("--api-key", help="API key (TUNEHOUSE_API_KEY)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    add_client_commands(sub, common)

    up = sub.add_parser("up", help="run the API, a worker and an inference worker on the embedded default")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--data-dir", dest="data_dir_sub")
    up.add_argument("--no-demo", action="store_true", help="do not submit the demo SFT job")
    up.add_argument(
        "--no-tinker", action="store_true", help="no Tinker API (neither its Tinker host nor a private Redis)"
    )
    up.set_defaults(func=cmd_up)

    worker = sub.add_parser("worker", help="run a Celery worker")
    worker.add_argument("--data-dir", dest="data_dir_sub")
    worker.add_argument("--loglevel", default="info")
    worker.add_argument(
        "--inference", action="store_true", help="serve /v1/chat/completions and /v1/completions, not jobs"
    )
    worker.add_argument(
        "--tinker", action="store_true", help="hold Tinker training clients (docs/tinker.md), not jobs"
    )
    worker.set_defaults(func=cmd_worker)

    models = sub.add_parser("models", help="base models: list them, add one to the catalogue")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    listing = models_sub.add_parser("list", parents=[common], help="the models you can train and try")
    listing.set_defaults(func=models_list)
    add = models_sub.add_parser(
        "add", help="store a base model (hub id or local folder) in the blob store, for every worker"
    )
    add.add_argument("source", help="a hub id (org/name) or a local Hugging Face model folder")
    add.add_argument("--name", help="the name jobs use (default: the hub id, or the folder's name)")
    add.add_argument("--revision", help="a hub branch, tag or commit (default: main), pinned as its commit")
    add.add_argument("--token", help="a hub token for a gated model (default: HF_TOKEN)")
    add.add_argument("--json", action="store_true")
    add.add_argument("--data-dir", dest="data_dir_sub")
    add.set_defaults(func=cmd_models_add)

    migrate = sub.add_parser("migrate", help="upgrade the database to the newest schema")
    migrate.add_argument("--data-dir", dest="data_dir_sub")
    migrate.set_defaults(func=cmd_migrate)

    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create an API key (and the tenant if new)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="")
    create.add_argument("--expires-in", help="e.g. 3600, 90m, 12h, 30d (default: never)")
    create.add_argument("--json", action="store_true")
    create.add_argument("--data-dir", dest="data_dir_sub")
    create.set_defaults(func=cmd_keys_create)
    listing = keys_sub.add_parser("list", help="list API keys (never their secrets)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    listing.add_argument("--json", action="store_true")
    listing.add_argument("--data-dir", dest="data_dir_sub")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke an API key at once, on every server")
    revoke.add_argument("key", help="the key's id (key-...), its prefix (th-...) or the key itself")
    revoke.add_argument("--data-dir", dest="data_dir_sub")
    revoke.set_defaults(func=cmd_keys_revoke)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _use_data_dir(getattr(args, "data_dir_sub", None) or args.data_dir)
    from tunehouse._exceptions import APIConnectionError, APIStatusError
    from tunehouse.cli_client import CLIError
    from tunehouse.resources.jobs import WaitTimeout

    try:
        return int(args.func(args))
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc.name or "")
        if extra is None:
            raise
        print(
            f"tunehouse: `{' '.join(sys.argv[1:3]) or args.command}` runs the service, which this install "
            f"lacks ({exc.name}): install tunehouse[{extra}] (pip install 'tunehouse[{extra}]')",
            file=sys.stderr,
        )
        return 2
    except (UserError, CLIError) as exc:
        print(f"tunehouse: {exc}", file=sys.stderr)
        return 2
    except APIStatusError as exc:
        where = f" [{exc.param}]" if exc.param else ""
        rid = f" (request id {exc.request_id})" if exc.request_id else ""
        print(f"tunehouse: error {exc.status_code}{where}: {exc.message}{rid}", file=sys.stderr)
        return 1
    except APIConnectionError as exc:
        print(f"tunehouse: cannot reach the API: {exc.message}", file=sys.stderr)
        return 1
    except WaitTimeout as exc:
        print(f"tunehouse: {exc}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
