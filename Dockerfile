# syntax=docker/dockerfile:1
# kvcache: one image for every role (`kvcache node | messenger | conductor | health ...`).
#   docker build -t kvcache:0.1.0 .
#   docker run --rm --shm-size 2g kvcache:0.1.0 node --listen 0.0.0.0:7000 --dram 1GiB
# deploy/compose.yaml and deploy/kubernetes/kvcache.yaml run it (kvcache deploy renders both).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with the CPU torch wheel and kvcache -----------------------
FROM ${PYTHON_IMAGE} AS build
# A compiler and xxhash.h for the C key chain and key index (kvstore/_native.c); build stage
# only, so the base image's Debian release pins them.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvcache
# torch first, the CPU wheel: a bare `torch` requirement would pull a multi-GB CUDA build. Its
# own layer: it changes far less often than kvcache.
# hadolint ignore=DL3059
RUN /opt/kvcache/bin/pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvcache ./kvcache
COPY bench ./bench
COPY conductor ./conductor
COPY messenger ./messenger
COPY node ./node
COPY clients ./clients
COPY plumbing ./plumbing
COPY rpc ./rpc
COPY router ./router
COPY kvstore ./kvstore
COPY proto ./proto
# The router's extra too: `kvcache router` runs from the same image.
RUN /opt/kvcache/bin/pip install '.[router]' \
 && /opt/kvcache/bin/python -c "import kvstore._native"

# ---- runtime: the environment only, a non-root user ------------------------------------------
FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 kvcache \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvcache
COPY --from=build /opt/kvcache /opt/kvcache
ENV PATH=/opt/kvcache/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVCACHE_HEALTH_ADDR=127.0.0.1:7000
USER 10001:10001
WORKDIR /tmp
# node gRPC, messenger gRPC, messenger data port, conductor gRPC, metrics (node / conductor,
# messenger)
EXPOSE 7000 7100 7200 7300 9100 9101
# gRPC health (grpc.health.v1) of this container's server; compose sets KVCACHE_HEALTH_ADDR per
# service, Kubernetes uses its own gRPC probes.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
  CMD ["sh", "-c", "exec kvcache health --timeout 3 \"$KVCACHE_HEALTH_ADDR\""]
ENTRYPOINT ["kvcache"]
CMD ["--help"]
