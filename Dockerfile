# vllm-guard gateway image: slim Python, pinned dependencies, non-root, exec-form entrypoint.
# Build:  docker build -t vllm-guard .
# Run:    docker run -p 8080:8080 vllm-guard --backend http://vllm:8000
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # glibc malloc tuning (vllm-guard serve applies the same when unset): 3 MB
    # screenshot bodies cost 11 ms of CPU instead of 32 ms when large blocks come
    # from a heap that keeps its memory instead of fresh mmap pages every request.
    MALLOC_MMAP_THRESHOLD_=33554432 \
    MALLOC_TRIM_THRESHOLD_=268435456

WORKDIR /app
# The lock pins the dependencies and the `tracing` extra's (OpenTelemetry, imported
# only where tracing.enabled): the image can trace without a rebuild.
COPY deploy/requirements.lock /app/requirements.lock
RUN pip install --no-cache-dir -r /app/requirements.lock

COPY pyproject.toml README.md /app/
COPY gateway /app/gateway
COPY config/vllm-guard.yaml /etc/vllm-guard/vllm-guard.yaml
RUN pip install --no-cache-dir --no-deps /app \
    && useradd --system --uid 10001 --no-create-home vllmguard

USER 10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"]
ENTRYPOINT ["vllm-guard", "serve"]
CMD ["--config", "/etc/vllm-guard/vllm-guard.yaml"]
