"""The client half of the CLI: files, jobs and checkpoints over the API, with `--json` for scripts.

Configuration: --base-url / --api-key, else TUNEHOUSE_BASE_URL / TUNEHOUSE_API_KEY, else the server a
running `tunehouse up` of the data dir (TUNEHOUSE_DATA_DIR, `.tunehouse`) serves and the key it keeps
there, else http://127.0.0.1:8000.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from tunehouse._base_client import DEFAULT_BASE_URL
from tunehouse._client import Client
from tunehouse.progress import ProgressPrinter

TERMINAL_EXIT = {"succeeded": 0, "failed": 1, "cancelled": 1}


class CLIError(Exception):
    """A user error: printed as one line."""


def _data_dir() -> Path:
    return Path(os.environ.get("TUNEHOUSE_DATA_DIR", ".tunehouse"))


def started_server() -> str | None:
    """The URL a `tunehouse up` of this data dir serves, while it runs (tunehouse/embedded.py writes it)."""
    try:
        endpoint = json.loads((_data_dir() / "endpoint.json").read_text())
        os.kill(int(endpoint["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(endpoint["base_url"])


def make_client(args: argparse.Namespace) -> Client:
    base_url = args.base_url or os.environ.get("TUNEHOUSE_BASE_URL") or started_server() or DEFAULT_BASE_URL
    api_key = args.api_key or os.environ.get("TUNEHOUSE_API_KEY")
    if not api_key:
        key_file = _data_dir() / "local_api_key"
        if key_file.exists():
            api_key = key_file.read_text().strip()
    if not api_key:
        raise CLIError(
            "no API key: pass --api-key or set TUNEHOUSE_API_KEY (create one: tunehouse keys create)"
        )
    return Client(base_url=base_url, api_key=api_key)


def emit(args: argparse.Namespace, obj: BaseModel | list[BaseModel], human: str) -> None:
    if args.json:
        data: Any = [o.model_dump() for o in obj] if isinstance(obj, list) else obj.model_dump()
        print(json.dumps(data, indent=2))
    else:
        print(human)


def _key_values(pairs: list[str] | None, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CLIError(f"{what} must look like key=value, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


# -- files --------------------------------------------------------------------------------------
def files_upload(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_file():
        raise CLIError(f"no such file: {path}")
    with make_client(args) as client:
        f = client.files.create(file=path, purpose=args.purpose)
    emit(args, f, f"{f.id}  {f.filename}  {f.format}  {f.line_count} examples  {f.bytes} bytes")
    return 0


def files_list(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        files = list(client.files.list(limit=args.limit))
    emit(args, list(files), "\n".join(f"{f.id}  {f.filename}  {f.format}  {f.line_count}" for f in files))
    return 0


def files_get(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        f = client.files.retrieve(args.file_id)
    emit(args, f, f"{f.id}  {f.filename}  {f.format}  {f.line_count} examples  sha256 {f.sha256}")
    return 0


def files_delete(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        deleted = client.files.delete(args.file_id)
    emit(args, deleted, f"deleted {deleted.id}")
    return 0


# -- jobs ---------------------------------------------------------------------------------------
def _job_line(job: Any) -> str:
    progress = f"{job.current_step}/{job.total_steps}" if job.total_steps else "-"
    extra = f"  {job.fine_tuned_model}" if job.fine_tuned_model else ""
    extra += f"  error: {job.error.message}" if job.error else ""
    return f"{job.id}  {job.status:<10} {job.method.get('type', '?'):<11} {progress:>9}  {job.model}{extra}"


def _resources(args: argparse.Namespace) -> dict[str, Any] | None:
    """The job's `resources` extension from --gpus and --strategy (None: the server's default)."""
    resources: dict[str, Any] = {}
    if args.gpus is not None:
        resources["gpus"] = args.gpus
    if args.strategy is not None:
        resources["strategy"] = args.strategy
    return resources or None


def _job_body(args: argparse.Namespace) -> dict[str, Any]:
    """The creation body of `jobs create` and `jobs estimate`, from their shared options."""
    hp = _key_values(args.hyperparameter, "--hyperparameter")
    method: dict[str, Any] = {"type": args.method, args.method: {"hyperparameters": hp}}
    if args.grader:
        method[args.method]["grader"] = json.loads(Path(args.grader).read_text())
    return {
        "model": args.model,
        "training_file": args.training_file,
        "validation_file": args.validation_file,
        "method": method,
        "suffix": args.suffix,
        "seed": args.seed,
        "metadata": {k: str(v) for k, v in _key_values(args.metadata, "--metadata").items()} or None,
        "resources": _resources(args),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _estimate_text(e: Any) -> str:
    tokens = e.trained_tokens
    verdict = {True: "runs", False: "cannot run", None: "unknown"}[e.fits]
    lines = [
        f"{verdict}" + (f": {e.reason}" if e.reason else ""),
        f"{e.examples} examples, {e.total_steps} steps, queue position {e.queue_position}",
        f"trained tokens: {tokens['per_epoch']} per epoch, {tokens['total']} in all"
        if tokens
        else f"trained tokens: - ({e.tokens_reason})",
    ]
    if e.truncated and e.truncated["count"]:
        lines.append(f"truncated: {e.truncated['count']} (lines {e.truncated['first_lines']})")
    wall = e.estimated_wall_time
    lines.append(
        f"wall time: {wall['seconds']} s"
        if wall["seconds"] is not None
        else f"wall time: - ({wall['reason']})"
    )
    for fit in e.peak_memory_bytes:
        kind, parts = fit["worker_kind"], fit["peak_memory_bytes"]
        verdict = {True: "fits", False: "does not fit", None: "unknown"}[fit["fits"]]
        lines.append(
            f"{kind['device']} {kind['device_name'] or ''} ({_gib(kind['device_memory_bytes'])}): "
            f"{_gib(parts['total'])} at peak, {verdict}"
        )
    for spans in e.preview[:1]:
        lines.append(
            "first example ([[trained]]): "
            + "".join(f"[[{s['text']}]]" if s["trained"] else s["text"] for s in spans)
        )
    return "\n".join(lines)


def jobs_estimate(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        estimate = client.fine_tuning.jobs.estimate(**_job_body(args))
        emit(args, estimate, _estimate_text(estimate))
    return 0


def jobs_create(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        job = client.fine_tuning.jobs.create(**_job_body(args))
        emit(args, job, _job_line(job))
        if args.wait:
            return _wait(args, client, job.id)
    return 0


def jobs_list(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        page = client.fine_tuning.jobs.list(limit=args.limit)
        jobs = page.data
    emit(args, list(jobs), "\n".join(_job_line(j) for j in jobs))
    return 0


def jobs_get(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        job = client.fine_tuning.jobs.retrieve(args.job_id)
    emit(args, job, _job_line(job))
    return 0


def jobs_control(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        job = getattr(client.fine_tuning.jobs, args.action)(args.job_id)
    emit(args, job, _job_line(job))
    return 0


def jobs_events(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        events = client.fine_tuning.jobs.list_events(args.job_id, limit=args.limit).data[::-1]
    emit(args, list(events), "\n".join(f"{e.created_at}  {e.level:<5} {e.message}" for e in events))
    return 0


def jobs_metrics(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        rows = list(client.fine_tuning.jobs.metrics(args.job_id))
    lines = []
    for row in rows:
        values = "  ".join(
            f"{k} {v:.4g}" for k, v in (row.model_extra or {}).items() if isinstance(v, int | float)
        )
        lines.append(f"step {row.step:>5}  epoch {row.epoch:.2f}  {values}")
    emit(args, list(rows), "\n".join(lines))
    return 0


def _wait(args: argparse.Namespace, client: Client, job_id: str) -> int:
    jobs = client.fine_tuning.jobs
    start = jobs.retrieve(job_id)
    printer = ProgressPrinter(start.total_steps)
    job = jobs.wait(job_id, timeout=args.timeout, on_item=None if args.json else printer)
    emit(args, job, _job_line(job))
    return TERMINAL_EXIT.get(job.status, 1)


def jobs_wait(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        return _wait(args, client, args.job_id)


# -- checkpoints --------------------------------------------------------------------------------
def checkpoints_list(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        ckpts = list(client.fine_tuning.jobs.checkpoints.list(args.job_id))
    lines = [
        f"{c.id}  step {c.step_number:>5}  {'final ' if c.is_final else ''}{c.fine_tuned_model_checkpoint}"
        for c in ckpts
    ]
    emit(args, list(ckpts), "\n".join(lines))
    return 0


def checkpoints_download(args: argparse.Namespace) -> int:
    dest = Path(args.output or f"{args.checkpoint_id}.tar")

    def progress(done: int, total: int | None) -> None:
        if sys.stderr.isatty():
            shown = f"{done / total:4.0%}" if total else f"{done} bytes"
            sys.stderr.write(f"\rdownloading {dest.name}: {shown}")

    with make_client(args) as client:
        client.fine_tuning.jobs.checkpoints.download(args.job_id, args.checkpoint_id, dest, progress=progress)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    print(json.dumps({"path": str(dest), "bytes": dest.stat().st_size}) if args.json else f"saved {dest}")
    return 0


def _job_options(p: argparse.ArgumentParser) -> None:
    """The options of a job's body (`jobs create` and `jobs estimate`)."""
    p.add_argument("--model", required=True)
    p.add_argument("--training-file", required=True)
    p.add_argument("--validation-file")
    p.add_argument("--method", default="supervised")
    p.add_argument("-p", "--hyperparameter", action="append", metavar="KEY=VALUE")
    p.add_argument("--grader", help="a JSON file with the grader (RL methods)")
    p.add_argument("--suffix")
    p.add_argument("--seed", type=int)
    p.add_argument("--gpus", type=int, help="GPUs (data-parallel ranks) for the job; default 1")
    p.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        help="ddp (each GPU holds the model; the default) or fsdp (weights and optimizer state sharded)",
    )
    p.add_argument("--metadata", action="append", metavar="KEY=VALUE")


# -- models and chat ----------------------------------------------------------------------------
def _model_line(m: Any) -> str:
    if m.architecture is None:
        return f"{m.id}  (fine-tuned, {m.owned_by})"
    size = f"{m.parameters / 1e6:,.1f}M params" if m.parameters else "? params"
    trains = ", ".join(m.trainable.methods) if m.trainable and m.trainable.methods else "nothing yet"
    return (
        f"{m.id}  {m.architecture}  {size}  context {m.context_length or '?'}  "
        f"{'+'.join(m.modalities or [])}  trains: {trains}"
    )


def models_list(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        models = client.models.list()
    emit(args, list(models), "\n".join(_model_line(m) for m in models))
    return 0


def chat(args: argparse.Namespace) -> int:
    """One question (the argument, or each line of standard input in turn), the reply printed as it
    is generated."""
    messages: list[dict[str, Any]] = []
    questions = [args.message] if args.message else (line.rstrip("\n") for line in sys.stdin)
    with make_client(args) as client:
        for question in questions:
            if not question:
                continue
            messages.append({"role": "user", "content": question})
            reply = []
            for chunk in client.chat.completions.stream(
                model=args.model, messages=messages, max_tokens=args.max_tokens, temperature=args.temperature
            ):
                reply.append(chunk.text)
                print(chunk.text, end="", flush=True)
            print(flush=True)
            messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def add_client_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    files = sub.add_parser("files", help="training files").add_subparsers(dest="files_command", required=True)
    p = files.add_parser("upload", parents=[common], help="upload a JSONL file")
    p.add_argument("path")
    p.add_argument("--purpose", default="fine-tune")
    p.set_defaults(func=files_upload)
    p = files.add_parser("list", parents=[common])
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=files_list)
    for name, func in (("get", files_get), ("delete", files_delete)):
        p = files.add_parser(name, parents=[common])
        p.add_argument("file_id")
        p.set_defaults(func=func)

    p = sub.add_parser("chat", parents=[common], help="ask a model; the reply streams as it is generated")
    p.add_argument("model", help="a base model, a fine-tuned model (ft:...) or a checkpoint")
    p.add_argument("message", nargs="?", help="the question (default: each line of standard input)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.set_defaults(func=chat)

    jobs = sub.add_parser("jobs", help="fine-tuning jobs").add_subparsers(dest="jobs_command", required=True)
    p = jobs.add_parser("estimate", parents=[common], help="estimate a job before creating it")
    _job_options(p)
    p.set_defaults(func=jobs_estimate)
    p = jobs.add_parser("create", parents=[common], help="create a job")
    _job_options(p)
    p.add_argument("--wait", action="store_true", help="then wait for it, with a progress bar")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=jobs_create)
    p = jobs.add_parser("list", parents=[common])
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(func=jobs_list)
    p = jobs.add_parser("get", parents=[common])
    p.add_argument("job_id")
    p.set_defaults(func=jobs_get)
    for action in ("cancel", "pause", "resume"):
        p = jobs.add_parser(action, parents=[common])
        p.add_argument("job_id")
        p.set_defaults(func=jobs_control, action=action)
    p = jobs.add_parser("events", parents=[common])
    p.add_argument("job_id")
    p.add_argument("--limit", type=int, default=50)
    p.set_defaults(func=jobs_events)
    p = jobs.add_parser("metrics", parents=[common])
    p.add_argument("job_id")
    p.set_defaults(func=jobs_metrics)
    p = jobs.add_parser("wait", parents=[common], help="wait for a job; non-zero exit unless it succeeds")
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=jobs_wait)

    ckpts = sub.add_parser("checkpoints", help="job checkpoints").add_subparsers(
        dest="ckpt_command", required=True
    )
    p = ckpts.add_parser("list", parents=[common])
    p.add_argument("job_id")
    p.set_defaults(func=checkpoints_list)
    p = ckpts.add_parser("download", parents=[common])
    p.add_argument("job_id")
    p.add_argument("checkpoint_id")
    p.add_argument("-o", "--output")
    p.set_defaults(func=checkpoints_download)
