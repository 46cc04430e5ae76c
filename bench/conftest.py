"""Benchmarks reuse the test fixtures (real PostgreSQL, Redis, uvicorn, Celery worker)."""

pytest_plugins = ["tests.conftest"]
