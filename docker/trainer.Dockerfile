# syntax=docker/dockerfile:1.7
# r3flow trainer: megatron-core GRPO/PPO with routing replay, launched by Ray (KubeRay RayJob).
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t r3flow-trainer:0.1.0 .
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /opt/r3flow

# torch comes from the base image; megatron-core, Ray and the HF stack are pinned here.
COPY docker/requirements-store.txt docker/requirements-trainer.txt /tmp/
RUN pip install --no-cache-dir -r /tmp/requirements-store.txt -r /tmp/requirements-trainer.txt

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY trainer ./trainer
# The C cores are built at image build time (the devel base has gcc) and installed with the package.
RUN python -m services.common._build --force \
    && pip install --no-cache-dir --no-deps . \
    && cd / && python -m services.common._build --check \
    && useradd --uid 10001 --user-group --create-home --shell /bin/bash r3flow

USER 10001:10001
EXPOSE 9400
# KubeRay overrides the command with `ray start`; the RayJob entrypoint runs `r3flow train`.
ENTRYPOINT ["r3flow"]
CMD ["train", "--config", "/etc/r3flow/train.yaml"]
