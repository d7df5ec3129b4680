# syntax=docker/dockerfile:1.7
# r3flow store: the TrajectoryStore gRPC service over Redis. Small: no torch, no vLLM.
# Build from the repository root: docker build -f docker/store.Dockerfile -t r3flow-store:0.1.0 .
# The C cores are built at image build time (services/common/_build.py), in a stage of the same
# base with a compiler, and copied into the package before it is installed.
FROM python:3.11.9-slim-bookworm AS cores
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY services ./services
RUN python -m services.common._build --force

FROM python:3.11.9-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/r3flow

COPY docker/requirements-store.txt /tmp/requirements-store.txt
RUN pip install --no-cache-dir -r /tmp/requirements-store.txt

# The CLI builds one parser for all subcommands (heavy imports happen only inside `run`), so the
# whole source tree goes in; only the store's dependencies do.
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY --from=cores /src/services/common/_routing_core.so /src/services/common/_routing_core.so.sha256 ./services/common/
COPY --from=cores /src/services/common/weight_sync/_pack_core.so /src/services/common/weight_sync/_pack_core.so.sha256 ./services/common/weight_sync/
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps . \
    && cd / && python -m services.common._build --check \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin r3flow

USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["r3flow"]
CMD ["store", "--config", "/etc/r3flow/store.yaml", "--listen", "0.0.0.0:50051", "--metrics-port", "9400"]
