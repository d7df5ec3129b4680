"""Access control of the TrajectoryStore: TLS (optionally mutual) and one bearer token per role.

Server side (`AuthConfig`, the store's `auth` section): certificate, key and client CA come from
files; each role's token comes from its own file (Kubernetes mounts them from Secrets). A gRPC
interceptor answers a missing or unknown token with UNAUTHENTICATED and a known token used for a
method outside its role with PERMISSION_DENIED. grpc.health.v1 and reflection stay open (probes).
Client side (`ClientAuthConfig`, the `store_auth` section of rollout and trainer configs): the
role's token file, the CA that signed the store's certificate, and a client cert/key for mTLS.

Secrets are never logged: only `fingerprint()` (8 hex digits of a SHA-256) and redacted URLs.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import grpc
from pydantic import Field, model_validator

from services.common.config import ConfigError, StrictConfig

log = logging.getLogger(__name__)

Role = Literal["rollout", "trainer"]
STORE_SERVICE = "r3flow.v1.TrajectoryStore"
_WATCH = {"WatchPolicyVersion", "WatchWeightSync", "GetStats"}
# The methods each role may call; any other TrajectoryStore method is PERMISSION_DENIED.
ROLE_METHODS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"Append", "AppendBatch", "RegisterWorker", "UnregisterWorker", *_WATCH}),
    "trainer": frozenset({"Pull", "PullChunks", "Ack", "PublishPolicyVersion", "PublishWeightSync",
                          "ListWorkers", "TrainerHeartbeat", *_WATCH}),
}


def fingerprint(secret: str | bytes) -> str:
    """A short, non-reversible label of a secret, safe to log."""
    data = secret.encode() if isinstance(secret, str) else secret
    return "sha256:" + hashlib.sha256(data).hexdigest()[:8]


def redact_url(url: str) -> str:
    """`redis://:pw@host:6379/0` -> `redis://:***@host:6379/0` (unchanged without a password)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def read_secret(path: str, field: str) -> bytes:
    """The bytes of a secret file (surrounding whitespace stripped); ConfigError (a ValueError)
    naming `field`."""
    p = Path(path)
    try:
        data = p.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{field}: cannot read {p}: {e.strerror}") from None
    if not data:
        raise ConfigError(f"{field}: {p} is empty")
    return data


def is_loopback(listen: str) -> bool:
    """Whether a `host:port` listen address only accepts local connections."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AuthConfig(StrictConfig):
    """Server side: TLS material and role tokens, all read from files (never inline values)."""

    tls_cert_file: str | None = Field(None, description="PEM server certificate (chain)")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")
    tls_ca_file: str | None = Field(
        None, description="PEM CA bundle that signs client certificates (mutual TLS)")
    require_client_cert: bool = Field(
        False, description="mutual TLS: refuse clients without a certificate signed by tls_ca_file")
    token_files: dict[Role, str] = Field(
        default_factory=dict, description="role -> file holding that role's bearer token; "
        "empty = no token check")

    @model_validator(mode="after")
    def _consistent(self) -> AuthConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file, tls_key_file: set both or neither")
        if self.require_client_cert and not (self.tls_ca_file and self.tls_cert_file):
            raise ValueError("require_client_cert: needs tls_cert_file, tls_key_file and "
                             "tls_ca_file")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


class ClientAuthConfig(StrictConfig):
    """Client side (`store_auth`): how a rollout worker or trainer proves who it is."""

    token_file: str | None = Field(None, description="file holding this role's bearer token")
    ca_file: str | None = Field(
        None, description="PEM CA that signed the store's certificate; set = use TLS")
    cert_file: str | None = Field(None, description="PEM client certificate (mutual TLS)")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    server_name: str | None = Field(
        None, description="name to check the store's certificate against, when it differs "
        "from the address host")

    @model_validator(mode="after")
    def _consistent(self) -> ClientAuthConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file, key_file: set both or neither")
        if self.cert_file and not self.ca_file:
            raise ValueError("cert_file: mutual TLS needs ca_file")
        return self


@dataclass(frozen=True)
class ClientAuth:
    """Loaded client secrets: channel credentials (None = plaintext) and the call metadata."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    server_name: str | None = None

    @classmethod
    def from_config(cls, cfg: ClientAuthConfig | None) -> ClientAuth | None:
        """Read the files named in `cfg`; None when nothing is configured."""
        if cfg is None or not (cfg.token_file or cfg.ca_file):
            return None
        creds = None
        if cfg.ca_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=read_secret(cfg.ca_file, "store_auth.ca_file"),
                private_key=read_secret(cfg.key_file, "store_auth.key_file")
                if cfg.key_file else None,
                certificate_chain=read_secret(cfg.cert_file, "store_auth.cert_file")
                if cfg.cert_file else None)
        metadata: tuple[tuple[str, str], ...] = ()
        if cfg.token_file:
            token = read_secret(cfg.token_file, "store_auth.token_file").decode()
            metadata = (("authorization", f"Bearer {token}"),)
            log.info("store client token %s (TLS %s)", fingerprint(token),
                     "on" if creds else "off")
        return cls(creds, metadata, cfg.server_name)

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A channel to `address`: TLS when credentials are set, plaintext otherwise."""
        if self.credentials is None:
            return grpc.insecure_channel(address, options=options)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(address, self.credentials, options=options)


def server_credentials(cfg: AuthConfig) -> grpc.ServerCredentials:
    """TLS credentials of the store (mutual when `require_client_cert`)."""
    assert cfg.tls_cert_file and cfg.tls_key_file
    pair = (read_secret(cfg.tls_key_file, "auth.tls_key_file"),
            read_secret(cfg.tls_cert_file, "auth.tls_cert_file"))
    ca = read_secret(cfg.tls_ca_file, "auth.tls_ca_file") if cfg.tls_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=cfg.require_client_cert)


def load_tokens(cfg: AuthConfig) -> dict[str, bytes]:
    """role -> token bytes from `token_files`; two roles may not share a token."""
    tokens: dict[str, bytes] = {role: read_secret(path, f"auth.token_files.{role}")
                                for role, path in cfg.token_files.items()}
    if len(set(tokens.values())) < len(tokens):
        raise ValueError("auth.token_files: each role needs its own token")
    return tokens


def _deny_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                  message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as `handler` that only aborts."""
    def deny(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class RoleTokenInterceptor(grpc.ServerInterceptor):
    """Bearer token -> role -> allowed methods, for the methods of `service` only."""

    def __init__(self, tokens: dict[str, bytes], service: str = STORE_SERVICE,
                 role_methods: dict[str, frozenset[str]] = ROLE_METHODS) -> None:
        if not tokens:
            raise ValueError("auth.token_files: at least one role token is needed")
        self._tokens = [(role, b"Bearer " + tok) for role, tok in tokens.items()]
        self._prefix = f"/{service}/"
        self._role_methods = role_methods

    def role_of(self, header: bytes) -> str | None:
        """The role whose token `header` carries; every token is compared (constant time)."""
        found = None
        for role, expected in self._tokens:
            if hmac.compare_digest(header, expected):
                found = role
        return found

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if not details.method.startswith(self._prefix):
            return continuation(details)  # health, reflection: open
        handler = continuation(details)
        if handler is None:
            return None
        header = dict(details.invocation_metadata).get("authorization", "")
        role = self.role_of(header.encode() if isinstance(header, str) else header)
        if role is None:
            return _deny_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                 "authorization: missing or unknown bearer token")
        method = details.method[len(self._prefix):]
        if method not in self._role_methods.get(role, frozenset()):
            return _deny_handler(handler, grpc.StatusCode.PERMISSION_DENIED,
                                 f"authorization: role {role!r} may not call {method}")
        return continuation(details)


def describe(cfg: AuthConfig, listen: str) -> str:
    """The one start-up line saying how the store is protected (plainly when it is not)."""
    if not cfg.tls and not cfg.token_files:
        where = "loopback only: local mode" if is_loopback(listen) else \
            "NOT loopback: anyone who can reach it may read and write trajectories"
        return f"INSECURE: store on {listen} without TLS and without tokens ({where})"
    tls = ("mutual TLS" if cfg.require_client_cert else "TLS") if cfg.tls else \
        "no TLS (tokens travel in plaintext)"
    roles = ", ".join(sorted(cfg.token_files)) or "none (no token check)"
    return f"store on {listen}: {tls}; role tokens: {roles}"
