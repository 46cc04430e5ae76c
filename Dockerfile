# One image for api, worker and migrate. On a GPU host pip resolves torch==2.13.0 to the CUDA build.
FROM python:3.11-slim
# bubblewrap: the sandbox of python graders (TUNEHOUSE_ALLOW_PYTHON_GRADER=1; docs/operations.md)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY service service
COPY worker worker
COPY trainers trainers
COPY tunehouse tunehouse
COPY migrations migrations
RUN pip install --no-cache-dir -e ".[server,train]"
ENV TUNEHOUSE_DATA_DIR=/data
EXPOSE 8000
CMD ["uvicorn", "service.app:app", "--host", "0.0.0.0", "--port", "8000"]
