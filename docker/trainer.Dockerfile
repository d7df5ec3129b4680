# syntax=docker/dockerfile:1.7
# r3flow trainer: megatron-core GRPO/PPO with routing replay, launched by Ray (KubeRay RayJob).
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t r3flow-trainer:0.1.0 .
# The base is the rollout image's (docker/rollout.Dockerfile): one torch and one NCCL build on
# both ends of the weight push (NCCL refuses peers of another NCCL version, and rollout engines
# refuse such a push by name: services/common/weight_sync/group.py nccl_mismatch).
FROM vllm/vllm-openai:v0.24.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /opt/r3flow
# a compiler for the C cores (services/common/_build.py); the vLLM base has none
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch comes from the base image (vLLM's pin); megatron-core, Ray and the HF stack are pinned here.
COPY docker/requirements-store.txt docker/requirements-trainer.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/requirements-store.txt -r /tmp/requirements-trainer.txt

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY trainer ./trainer
# The C cores are built at image build time and installed with the package.
RUN python3 -m services.common._build --force \
    && pip install --no-cache-dir --no-deps . \
    && cd / && python3 -m services.common._build --check \
    && useradd --uid 10001 --user-group --create-home --shell /bin/bash r3flow

USER 10001:10001
EXPOSE 9400
# KubeRay overrides the command with `ray start`; the RayJob entrypoint runs `r3flow train`.
ENTRYPOINT ["r3flow"]
CMD ["train", "--config", "/etc/r3flow/train.yaml"]
