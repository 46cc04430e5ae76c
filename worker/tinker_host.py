"""A Tinker host: the worker process that holds base models and the training clients' LoRA adapters on
them (trainers/families/adapter_host.py) and runs the calls the API queues for it, one at a time, in
order (service/tinker/channel.py says the way there and back).

Run with `tunehouse worker --tinker` (needs TUNEHOUSE_REDIS_URL). What it keeps: one AdapterHost per
base model, loaded on the first client of that base; each client's adapter until the client has been
idle `TUNEHOUSE_TINKER_IDLE_SECONDS` with no gradient pending, when it is saved to the blob store and
freed, and restored exactly (weights, optimizer) by its next call.
Saved states and sampler weights go to the blob store (`tinker/<tenant>/<run>/<kind>/<name>.pt`); a
named one is also a tunehouse model: a peft adapter folder's tar beside it and a row in PostgreSQL
(service/base_models/tinker_checkpoints.py), for /v1/models, /v1/chat/completions and jobs.

When the host dies, its adapters' unsaved state is gone: the call it was running and those queued for
it fail (the API sees that its heartbeat key expired), and its clients answer 410 `tinker_client_lost`
(service/tinker/service.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT, FieldT

from service.base_models.tinker_checkpoints import (
    expired_tinker_checkpoints,
    forget_tinker_checkpoint,
    record_tinker_checkpoint,
    tinker_blob_key,
    tinker_path,
)
from service.config import Settings, get_settings
from service.db import session_scope
from service.ids import new_id
from service.storage import BlobStore, get_blob_store
from service.tinker import channel, runs, wire
from service.tinker.channel import Call, Result, key
from service.tinker.service import RECORD_TTL_SECONDS
from trainers.families.adapter_files import read_adapter_folder, write_adapter_folder
from trainers.families.adapter_host import Adam, AdapterHost, AdapterSpec, HostError
from worker.models import ModelNotAvailable, resolve_model_path, unpack_checkpoint
from worker.reporter import tar_folder

log = logging.getLogger("tunehouse.tinker")
_blob_key = tinker_blob_key
# a Redis that hangs or restarts: the host waits and reconnects (backoff from the first to the last)
# instead of exiting; the job workers ride out the same outage (worker/outage.py)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
BACKOFF_FIRST, BACKOFF_LAST = 0.2, 5.0
# a blocking read waits at most 1 s, so a reply later than this means Redis hangs
SOCKET_TIMEOUT_SECONDS = 5.0
SWEEP_SECONDS = 10.0  # how often a host deletes expired checkpoints


def _snapshot_name(path: str) -> str:
    # peft adapter names become module keys: no '.', no '/'
    return "s" + hashlib.sha1(path.encode()).hexdigest()[:16]


class TinkerHost:
    def __init__(
        self, settings: Settings, redis: Redis, blobs: BlobStore, host_id: str | None = None
    ) -> None:
        self.settings, self.redis, self.blobs = settings, redis, blobs
        self.host_id = host_id or f"tinkerhost-{os.getpid()}-{os.urandom(4).hex()}"
        self.bases: dict[str, AdapterHost] = {}  # resolved base path -> its host
        self.tokenizers: dict[str, Any] = {}
        self.where: dict[str, str] = {}  # adapter (training run or snapshot) -> resolved base path
        self.last_used: dict[str, tuple[float, str]] = {}  # training client -> (last call, its tenant)
        self.evicted: dict[str, str] = {}  # training client saved and freed while idle -> its tenant
        self.stopping = threading.Event()
        self._take = self.redis.register_script(channel.TAKE)
        self.swept = float("-inf")

    # --- liveness -----------------------------------------------------------------------------------

    def announce(self) -> None:
        self.redis.set(channel.key("host", self.host_id), str(time.time()), ex=channel.HOST_TTL_SECONDS)
        self.redis.sadd(channel.HOSTS, self.host_id)
        self.reclaim()

    def reclaim(self) -> None:
        """After Redis lost its data (a restart), the live part of each run this host holds, from its row
        in PostgreSQL: the run's calls find this host again instead of answering 410."""
        held = {model_id: tenant for model_id, (_, tenant) in self.last_used.items()} | self.evicted
        if not held:
            return
        with self.redis.pipeline(transaction=False) as pipe:
            for model_id in held:
                pipe.hexists(key("model", model_id), "host")
            present = pipe.execute()
        lost = [model_id for model_id, there in zip(held, present, strict=True) if not there]
        if not lost:
            return
        with session_scope() as session:
            rows = [runs.find_run(session, tenant_id=held[m], run_id=m) for m in lost]
            restored = [
                (
                    row.id,
                    {
                        "tenant_id": row.tenant_id,
                        "session_id": row.session_id,
                        "base_model": row.base_model,
                        "spec": json.dumps(row.spec),
                        "metadata": json.dumps(row.user_metadata),
                        "host": self.host_id,
                        "created": float(row.created_at),
                        "calls": 0,
                    },
                )
                for row in rows
            ]
        for model_id, mapping in restored:
            self.redis.hset(key("model", model_id), mapping=mapping)  # type: ignore[arg-type]
            self.redis.sadd(key("host_models", self.host_id), model_id)
        log.info("tinker host %s: restored %d runs Redis had lost", self.host_id, len(restored))

    def _heartbeat(self) -> None:
        while not self.stopping.wait(channel.HEARTBEAT_SECONDS):
            try:
                self.announce()
            except Exception:  # Redis briefly down: the next beat tries again
                log.warning("tinker host heartbeat failed", exc_info=True)

    # --- the loop -----------------------------------------------------------------------------------

    def _until_redis_answers(self, what: str, step: Any) -> Any:
        """`step()`, retried with backoff while Redis is down or hangs; None if the host stops first."""
        delay = BACKOFF_FIRST
        while True:
            try:
                return step()
            except REDIS_DOWN as exc:
                if self.stopping.is_set():
                    return None
                log.warning(
                    "tinker host: Redis unavailable (%s) while %s; retrying in %.1fs", exc, what, delay
                )
                self.stopping.wait(delay)
                delay = min(delay * 2, BACKOFF_LAST)

    def take(self) -> bytes | None:
        """The next call, round-robin over tenants and their clients (service/tinker/channel.py); waits
        up to a second on `wake` when nothing is queued."""
        ring, taken = channel.key("ring", self.host_id), channel.key("taken", self.host_id)
        raw = self._take(keys=[ring, taken], args=[channel.PREFIX, self.host_id])
        if raw is None:
            self.redis.blpop([channel.key("wake", self.host_id)], timeout=1)
            return None
        return raw if isinstance(raw, bytes) else str(raw).encode()

    def serve(self) -> None:
        self._until_redis_answers("announcing", self.announce)
        threading.Thread(target=self._heartbeat, daemon=True, name="tinker-heartbeat").start()
        log.info("tinker host %s ready", self.host_id)
        while not self.stopping.is_set():
            raw = self._until_redis_answers("waiting for calls", self.take)
            if raw is not None:
                self.run_one(raw)
            self._until_redis_answers("freeing idle clients", lambda: self.evict_idle(time.monotonic()))
            self.sweep_expired(time.monotonic())
        self._until_redis_answers("leaving", lambda: self.redis.delete(channel.key("host", self.host_id)))

    def run_one(self, raw: bytes) -> None:
        call = Call.decode(raw)
        started = time.perf_counter()
        try:
            result = self.handle(call)
        except (HostError, ModelNotAvailable) as exc:
            result = Result.error(str(exc), "user")
        except Exception as exc:  # a bug or an OOM: the call fails, the host goes on
            log.exception("tinker call %s (%s) failed", call.request_id, call.op)
            result = Result.error(f"{type(exc).__name__}: {exc}", "server")
        # the call's own time on this host, for the overhead benchmark (bench/test_tinker_overhead.py)
        mapping = result.mapping() | {"compute_s": time.perf_counter() - started}

        def publish() -> None:
            with self.redis.pipeline() as pipe:
                pipe.hset(channel.key("result", call.request_id), mapping=mapping)
                pipe.expire(channel.key("result", call.request_id), channel.RESULT_TTL_SECONDS)
                pipe.rpush(channel.key("done", call.request_id), b"1")
                pipe.expire(channel.key("done", call.request_id), channel.RESULT_TTL_SECONDS)
                pipe.lrem(channel.key("taken", self.host_id), 1, raw)  # type: ignore[arg-type]  # bytes are fine
                pipe.execute()

        # a result computed while Redis is down is kept until Redis takes it: the client waits, then gets it
        self._until_redis_answers("storing a result", publish)

    def handle(self, call: Call) -> Result:
        op = getattr(self, f"op_{call.op}", None)
        if op is None:
            raise HostError(f"unknown call '{call.op}'")
        model_id = call.args.get("model_id")
        if model_id is not None:
            self.last_used[model_id] = (time.monotonic(), call.tenant_id)
        result: Result = op(call.tenant_id, **call.args)
        return result

    # --- idle clients -------------------------------------------------------------------------------

    def evict_idle(self, now: float) -> None:
        """Save and free each training client idle for `tinker_idle_seconds` with no gradient pending (a
        forward_backward waiting for its optim_step keeps its client): `_host_of` restores it."""
        for model_id, (used, tenant_id) in list(self.last_used.items()):
            if now - used < self.settings.tinker_idle_seconds or model_id not in self.where:
                continue
            host = self.bases[self.where[model_id]]
            if model_id not in host.adapters or host.has_pending_gradients(model_id):
                continue
            self._store(tenant_id, model_id, "evicted", "state", host.state(model_id))
            host.remove(model_id)
            self.evicted[model_id] = tenant_id
            del self.last_used[model_id]
            self.redis.hset(key("model", model_id), "evicted_at", time.time())
            log.info("training client %s idle: saved and freed", model_id)

    def sweep_expired(self, now: float) -> None:
        """Every SWEEP_SECONDS, delete the checkpoints past their TTL, rows then blobs (the listings hide
        them from their expiry on). Any host may: a row deleted twice is deleted once."""
        if now - self.swept < SWEEP_SECONDS:
            return
        self.swept = now
        try:
            with session_scope() as session:
                blob_keys = [
                    k
                    for row in expired_tinker_checkpoints(session)
                    for k in forget_tinker_checkpoint(session, row=row)
                ]
        except Exception:  # the database briefly down: the next sweep tries again
            log.warning("tinker host: expired checkpoint sweep failed", exc_info=True)
            return
        for blob_key in blob_keys:
            self.blobs.delete(blob_key)

    # --- helpers ------------------------------------------------------------------------------------

    def _base(self, tenant_id: str, name: str) -> tuple[str, AdapterHost]:
        path = resolve_model_path(
            self.settings, self.blobs, tenant_id=tenant_id, name=name, param="base_model"
        )
        if path not in self.bases:
            self.bases[path] = AdapterHost(path)
            # the API bounds a sample's prompt plus max_tokens by it (a 400 before the call is queued)
            self.redis.set(key("context", name), self.bases[path].context)
        return path, self.bases[path]

    def _host_of(self, name: str) -> AdapterHost:
        path = self.where.get(name)
        if path is None:
            raise HostError(f"training client '{name}' is not on this worker")
        host = self.bases[path]
        if name in self.evicted:  # saved while idle: back as it was, optimizer included
            tenant_id = self.evicted.pop(name)
            host.load_state(name, self._stored(tenant_id, name, "evicted", "state"), optimizer=True)
            self.redis.hdel(key("model", name), "evicted_at")
        return host

    def _store(self, tenant_id: str, model_id: str, kind: str, name: str, state: dict[str, Any]) -> str:
        """The state as the host reads it back; listed (and a model) only once `_export` records it."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with self.blobs.writer(_blob_key(tenant_id, model_id, kind, name)) as out:
            out.write(buffer.getvalue())
        return tinker_path(model_id, kind, name)

    def _export(
        self,
        tenant_id: str,
        model_id: str,
        kind: str,
        name: str,
        state: dict[str, Any],
        ttl_seconds: int | None = None,
    ) -> None:
        """The checkpoint as a tunehouse model: its adapter folder (with the base's tokenizer, which
        inference reads from the folder) as a tar in the blob store, then its row in PostgreSQL."""
        base_model = self.redis.hget(key("model", model_id), "base_model")
        if base_model is None:
            raise HostError(f"training client '{model_id}' has no training run")
        checkpoint_id = new_id("ftckpt")
        blob_key = f"tinker/{tenant_id}/{model_id}/{kind}/{name}-{checkpoint_id}.tar"
        with tempfile.TemporaryDirectory(prefix="tinker-export-") as tmp:
            folder = Path(tmp) / "adapter"
            write_adapter_folder(folder, state)
            self._tokenizer(self.where[model_id]).save_pretrained(str(folder))
            size = tar_folder(folder, Path(tmp) / "adapter.tar")
            self.blobs.put_file(blob_key, Path(tmp) / "adapter.tar")
        with session_scope() as session:
            record_tinker_checkpoint(
                session,
                tenant_id=tenant_id,
                training_run_id=model_id,
                kind=kind,
                name=name,
                base_model=base_model.decode() if isinstance(base_model, bytes) else str(base_model),
                blob_key=blob_key,
                size=size,
                checkpoint_id=checkpoint_id,
                ttl_seconds=ttl_seconds,
            )

    def _job_adapter(self, job_checkpoint: dict[str, str]) -> dict[str, Any]:
        """A job's LoRA checkpoint as a training client's state (weights only)."""
        folder = unpack_checkpoint(
            self.settings,
            self.blobs,
            checkpoint_id=job_checkpoint["checkpoint_id"],
            blob_key=job_checkpoint["blob_key"],
        )
        return read_adapter_folder(folder)

    def _stored(self, tenant_id: str, model_id: str, kind: str, name: str) -> dict[str, Any]:
        try:
            with self.blobs.open(_blob_key(tenant_id, model_id, kind, name)) as fh:
                data = fh.read()
        except FileNotFoundError as exc:
            raise HostError(f"no checkpoint {tinker_path(model_id, kind, name)}") from exc
        state: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
        return state

    # --- calls --------------------------------------------------------------------------------------

    def op_create_model(
        self, tenant_id: str, *, model_id: str, base_model: str, spec: dict[str, Any]
    ) -> Result:
        path, host = self._base(tenant_id, base_model)
        host.create(model_id, AdapterSpec(**spec))
        self.where[model_id] = path
        return Result.json({"type": "create_model", "model_id": model_id})

    def op_forward_backward(
        self,
        tenant_id: str,
        *,
        model_id: str,
        loss_fn: str,
        config: dict[str, float],
        forward_only: bool,
        data: list[Any],
    ) -> Result:
        host = self._host_of(model_id)
        outputs, metrics = host.forward_backward(
            model_id,
            [(tokens, inputs) for tokens, inputs in data],
            loss_fn=loss_fn,
            config=config,
            forward_only=forward_only,
        )
        self.redis.hset(
            key("model", model_id), mapping={"last_loss": metrics["loss:sum"], "last_call": time.time()}
        )
        return Result("proto", wire.write_forward_backward_output(outputs, metrics))

    def op_optim_step(self, tenant_id: str, *, model_id: str, adam: dict[str, float]) -> Result:
        metrics = self._host_of(model_id).optim_step(model_id, Adam(**adam))
        self.redis.hincrby(key("model", model_id), "steps", 1)
        return Result.json({"type": "optim_step", "metrics": metrics})

    def op_save_weights(
        self, tenant_id: str, *, model_id: str, name: str | None, ttl_seconds: int | None = None
    ) -> Result:
        host = self._host_of(model_id)
        name = name or f"step-{host.adapters[model_id].steps:06d}"
        state = host.state(model_id)
        path = self._store(tenant_id, model_id, "weights", name, state)
        self._export(tenant_id, model_id, "weights", name, state, ttl_seconds)
        return Result.json({"type": "save_weights", "path": path})

    def op_save_weights_for_sampler(
        self,
        tenant_id: str,
        *,
        model_id: str,
        name: str,
        sampling_session_id: str | None = None,
        ttl_seconds: int | None = None,
    ) -> Result:
        host = self._host_of(model_id)
        state = host.state(model_id, optimizer=False)
        path = self._store(tenant_id, model_id, "sampler_weights", name, state)
        snapshot = _snapshot_name(path)
        host.snapshot(snapshot, state["weights"], state["spec"])
        self.where[snapshot] = self.where[model_id]
        if sampling_session_id is not None:  # unnamed: it serves its sampling client only, unlisted
            return Result.json(
                {"type": "save_weights_for_sampler", "sampling_session_id": sampling_session_id}
            )
        self._export(tenant_id, model_id, "sampler_weights", name, state, ttl_seconds)  # named: a model too
        return Result.json({"type": "save_weights_for_sampler", "path": path})

    def op_load_weights(
        self,
        tenant_id: str,
        *,
        model_id: str,
        path: str,
        optimizer: bool,
        source: str | None = None,
        name: str | None = None,
        job_checkpoint: dict[str, str] | None = None,
        blank: bool = False,
        create: bool = False,
        base_model: str | None = None,
        spec: dict[str, Any] | None = None,
    ) -> Result:
        """A saved state (`source`, `name`), a job's LoRA checkpoint (`job_checkpoint`: weights only), or
        (`blank`, with `create`) nothing: a new client on a job's final model, which is its base."""
        if create:
            assert base_model is not None and spec is not None
            base_path, _ = self._base(tenant_id, base_model)
            self.where[model_id] = base_path
        if blank:
            assert create and spec is not None
            self._host_of(model_id).create(model_id, AdapterSpec(**spec))
            return Result.json({"type": "load_weights", "path": path, "model_id": model_id})
        if job_checkpoint is not None:
            state = self._job_adapter(job_checkpoint)
        else:
            assert source is not None and name is not None
            state = self._stored(tenant_id, source, "weights", name)
        if create:  # the client takes the state's own shape (the API may have registered a placeholder)
            self.redis.hset(key("model", model_id), "spec", json.dumps(state["spec"]))
            with session_scope() as session:
                runs.set_run_spec(session, run_id=model_id, spec=state["spec"])
        self._host_of(model_id).load_state(model_id, state, optimizer=optimizer)
        return Result.json({"type": "load_weights", "path": path, "model_id": model_id})

    def op_sample(
        self,
        tenant_id: str,
        *,
        base_model: str,
        model_path: str | None,
        prompt: list[int],
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: list[Any],
        prompt_logprobs: bool,
        top_k: int = 0,
        topk_prompt_logprobs: int = 0,
        record: dict[str, Any] | None = None,
    ) -> Result:
        base_path, host = self._base(tenant_id, base_model)
        if len(prompt) + max_tokens > host.context:
            raise HostError(
                f"prompt: {len(prompt)} prompt tokens plus max_tokens {max_tokens} exceed the model's "
                f"context of {host.context} tokens"
            )
        adapter = None
        if model_path is not None:
            adapter = _snapshot_name(model_path)
            if adapter not in host.snapshots:  # saved by another host, or before a restart
                run, _, name = model_path.removeprefix("tinker://").split("/")
                state = self._stored(tenant_id, run, "sampler_weights", name)
                host.snapshot(adapter, state["weights"], state["spec"])
                self.where[adapter] = base_path
        stop_tokens = {int(s) for s in stop if isinstance(s, int)}
        stop_texts = [s for s in stop if isinstance(s, str) and s]
        stops_at = None
        if stop_texts:
            tokenizer = self._tokenizer(base_path)

            def stops_at(tokens: list[int]) -> bool:
                text = tokenizer.decode(tokens)
                return any(s in text for s in stop_texts)

        sequences = host.sample(
            adapter,
            prompt,
            num_samples=num_samples,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_tokens=stop_tokens,
            seed=seed,
            stops_at=stops_at,
        )
        scored, topk = (
            host.prompt_logprobs(adapter, prompt, top=topk_prompt_logprobs)
            if prompt_logprobs
            else (None, None)
        )
        if record is not None:  # for stable_reinforce: what this sampler gave each sequence
            self._record(tenant_id, record, prompt, sequences)
        return Result(
            "proto",
            wire.write_sample_response(
                [wire.Sequence(s.tokens, s.logprobs, s.stop_reason) for s in sequences], scored, topk
            ),
        )

    def _record(
        self, tenant_id: str, record: dict[str, Any], prompt: list[int], sequences: list[Any]
    ) -> None:
        with self.redis.pipeline(transaction=False) as pipe:
            for sequence_id, seq in zip(record["sequence_ids"], sequences, strict=True):
                fields: dict[FieldT, EncodableT] = {
                    "tenant_id": tenant_id,
                    "session_id": record["session_id"],
                    "prompt": json.dumps(prompt),
                    "tokens": json.dumps(seq.tokens),
                    "logprobs": json.dumps(seq.logprobs),
                }
                pipe.hset(key("sequence", sequence_id), mapping=fields)
                pipe.expire(key("sequence", sequence_id), RECORD_TTL_SECONDS)
            pipe.execute()

    def _tokenizer(self, base_path: str) -> Any:
        if base_path not in self.tokenizers:
            from trainers.modeling.loading import load_tokenizer

            self.tokenizers[base_path] = load_tokenizer(base_path)
        return self.tokenizers[base_path]


def supervise() -> None:
    """`tunehouse worker --tinker`: the host in a child process, started again when it dies (an OOM, a
    crash), after a pause that doubles up to BACKOFF_LAST while it keeps dying within a minute. SIGTERM
    and SIGINT stop the child and then this process; the child dies with this process (PDEATHSIG)."""
    import ctypes
    import subprocess
    import sys

    def die_with_parent() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    stopping = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def stop(*_: Any) -> None:
        stopping.set()
        if child:
            child[0].terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    delay = BACKOFF_FIRST
    while not stopping.is_set():
        started = time.monotonic()
        child[:] = [
            subprocess.Popen([sys.executable, "-m", "worker.tinker_host"], preexec_fn=die_with_parent)
        ]
        code = child[0].wait()
        if stopping.is_set() or code == 0:
            return
        delay = BACKOFF_FIRST if time.monotonic() - started > 60 else min(delay * 2, BACKOFF_LAST)
        log.error("tinker host exited with %s; starting it again in %.1fs", code, delay)
        stopping.wait(delay)


def main() -> None:
    settings = get_settings()
    if not settings.redis_url:
        raise SystemExit("a Tinker host needs Redis: set TUNEHOUSE_REDIS_URL")
    logging.basicConfig(level=os.environ.get("TUNEHOUSE_LOG_LEVEL", "INFO"))
    redis = Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
        socket_timeout=SOCKET_TIMEOUT_SECONDS,
    )
    host = TinkerHost(settings, redis, get_blob_store())
    signal.signal(signal.SIGTERM, lambda *_: host.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: host.stopping.set())
    host.serve()


if __name__ == "__main__":
    main()
