# One image for the API, every worker (training, inference, Tinker), the migration and Ray nodes, with every
# runtime extra (server, train, trackers, ray). Two variants, chosen at build time:
#   docker build -t tunehouse:0.1.0-cuda .                        # CUDA: torch's default wheel (its CUDA libraries)
#   docker build --build-arg VARIANT=cpu -t tunehouse:0.1.0 .     # CPU: torch's CPU wheel, ~3 GB smaller
# The CUDA variant needs only the NVIDIA driver on the host (NVIDIA Container Toolkit); the libraries ship in
# the wheels. It runs as the unprivileged user 10001 (the Helm chart's securityContext expects it).
FROM python:3.11-slim
# bubblewrap: the sandbox of python graders (TUNEHOUSE_ALLOW_PYTHON_GRADER=1; docs/operations.md)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*
ARG VARIANT=cuda
RUN useradd --uid 10001 --user-group --create-home tunehouse && mkdir -p /data/models && chown -R tunehouse:tunehouse /data
WORKDIR /app
# torch first, pinned as pyproject.toml pins it: the CPU variant from torch's CPU index
RUN if [ "$VARIANT" = "cpu" ]; then \
      pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
    else \
      pip install --no-cache-dir torch==2.13.0; \
    fi
COPY pyproject.toml README.md alembic.ini ./
COPY service service
COPY worker worker
COPY trainers trainers
COPY tunehouse tunehouse
COPY migrations migrations
RUN pip install --no-cache-dir ".[server,train,trackers,ray]"
USER 10001
ENV TUNEHOUSE_DATA_DIR=/data HOME=/home/tunehouse
EXPOSE 8000
CMD ["uvicorn", "service.app:app", "--host", "0.0.0.0", "--port", "8000"]
