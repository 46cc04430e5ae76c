"""The `tunehouse` command. Server-side commands import the service lazily, so the SDK side of this
package never pulls in FastAPI or torch at import time.

    tunehouse up [--host H] [--port P] [--data-dir D] [--no-demo]   API + one worker, embedded default
    tunehouse worker [--data-dir D]                                 a Celery worker
    tunehouse migrate                                               alembic upgrade head
    tunehouse keys create --tenant NAME [--json]                    a new API key (last line, or JSON)
    tunehouse files upload|list|get|delete ...                      training files
    tunehouse jobs create|list|get|cancel|pause|resume|events|metrics|wait ...
    tunehouse checkpoints list|download ...

Client commands take --base-url / --api-key (or TUNEHOUSE_BASE_URL / TUNEHOUSE_API_KEY) and --json.
User errors print one line and exit non-zero; `jobs wait` exits 0 only when the job succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


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


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service.auth import create_api_key
    from service.config import get_settings
    from service.db import session_scope
    from service.migrate import upgrade_head

    if not args.tenant.strip():
        raise UserError("--tenant must not be empty")
    upgrade_head(get_settings().database_url)
    with session_scope() as session:
        tenant, key = create_api_key(session, tenant_name=args.tenant.strip(), key_name=args.name or "")
        tenant_id = tenant.id
    if args.json:
        print(json.dumps({"tenant": args.tenant, "tenant_id": tenant_id, "api_key": key}))
    else:
        print(f"created an API key for tenant '{args.tenant}' ({tenant_id}); it is shown only once:")
        print(key)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.celery_app import app

    argv = [
        "worker",
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "-Q",
        "tunehouse",
        "--loglevel",
        args.loglevel,
        "--without-gossip",
        "--without-mingle",
        "-n",
        f"tunehouse-{os.getpid()}@%h",
    ]
    app.worker_main(argv)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from tunehouse.embedded import run_embedded

    return run_embedded(host=args.host, port=args.port, demo=not args.no_demo)


def build_parser() -> argparse.ArgumentParser:
    from tunehouse.cli_client import add_client_commands

    parser = argparse.ArgumentParser(prog="tunehouse", description="OpenAI-compatible training service")
    parser.add_argument("--data-dir", help="state folder for the embedded default (TUNEHOUSE_DATA_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", help="API URL (TUNEHOUSE_BASE_URL; default http://127.0.0.1:8000)")
    common.add_argument("--api-key", help="API key (TUNEHOUSE_API_KEY)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    add_client_commands(sub, common)

    up = sub.add_parser("up", help="run the API and one worker on the embedded default")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--data-dir", dest="data_dir_sub")
    up.add_argument("--no-demo", action="store_true", help="do not submit the demo SFT job")
    up.set_defaults(func=cmd_up)

    worker = sub.add_parser("worker", help="run a Celery worker")
    worker.add_argument("--data-dir", dest="data_dir_sub")
    worker.add_argument("--loglevel", default="info")
    worker.set_defaults(func=cmd_worker)

    migrate = sub.add_parser("migrate", help="upgrade the database to the newest schema")
    migrate.add_argument("--data-dir", dest="data_dir_sub")
    migrate.set_defaults(func=cmd_migrate)

    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create an API key (and the tenant if new)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="")
    create.add_argument("--json", action="store_true")
    create.add_argument("--data-dir", dest="data_dir_sub")
    create.set_defaults(func=cmd_keys_create)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _use_data_dir(getattr(args, "data_dir_sub", None) or args.data_dir)
    from tunehouse._exceptions import APIConnectionError, APIStatusError
    from tunehouse.cli_client import CLIError
    from tunehouse.resources.jobs import WaitTimeout

    try:
        return int(args.func(args))
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
