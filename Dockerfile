# One image for api, worker and migrate. On a GPU host pip resolves torch==2.13.0 to the CUDA build.
FROM python:3.11-slim
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
