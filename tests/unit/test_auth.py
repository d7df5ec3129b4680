"""services/common/auth.py: configs, secret files, redaction and the role-token interceptor."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.common.auth import (
    ROLE_METHODS,
    AuthConfig,
    ClientAuth,
    ClientAuthConfig,
    RoleTokenInterceptor,
    describe,
    fingerprint,
    is_loopback,
    load_tokens,
    read_secret,
    redact_url,
)
from services.common.config import ConfigError, build_config
from services.common.pb.r3flow.v1 import store_pb2
from services.store.config import StoreConfig


def test_every_store_method_belongs_to_a_role() -> None:
    methods = set(store_pb2.DESCRIPTOR.services_by_name["TrajectoryStore"].methods_by_name)
    assert set().union(*ROLE_METHODS.values()) == methods
    assert "Pull" not in ROLE_METHODS["rollout"] and "Append" not in ROLE_METHODS["trainer"]


@pytest.mark.parametrize("url, want", [
    ("redis://:hunter2@redis:6379/0", "redis://:***@redis:6379/0"),
    ("redis://default:hunter2@10.0.0.1:6379", "redis://default:***@10.0.0.1:6379"),
    ("rediss://u:p%40ss@h/1", "rediss://u:***@h/1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redact_url(url: str, want: str) -> None:
    assert redact_url(url) == want


def test_store_config_dump_redacts_redis_password() -> None:
    cfg = StoreConfig(redis_url="redis://:hunter2@redis:6379/0")
    assert "hunter2" not in cfg.model_dump_json()
    assert cfg.redis_url == "redis://:hunter2@redis:6379/0"  # the value itself is intact


def test_fingerprint_is_short_and_stable() -> None:
    assert fingerprint("abc") == fingerprint(b"abc") != fingerprint("abd")
    assert fingerprint("abc").startswith("sha256:") and "abc" not in fingerprint("abc")[7:]


@pytest.mark.parametrize("listen, loop", [("127.0.0.1:1", True), ("localhost:1", True),
                                          ("[::1]:1", True), ("0.0.0.0:1", False),
                                          ("store:50051", False)])
def test_is_loopback(listen: str, loop: bool) -> None:
    assert is_loopback(listen) is loop


def test_insecure_startup_line_says_so() -> None:
    assert describe(AuthConfig(), "127.0.0.1:5").startswith("INSECURE")
    assert "NOT loopback" in describe(AuthConfig(), "0.0.0.0:5")
    line = describe(AuthConfig(token_files={"trainer": "/t"}), "0.0.0.0:5")
    assert "plaintext" in line and "trainer" in line


def test_read_secret_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auth.x: cannot read"):
        read_secret(str(tmp_path / "missing"), "auth.x")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="auth.y: .* is empty"):
        read_secret(str(tmp_path / "empty"), "auth.y")
    (tmp_path / "t").write_text("  tok\n")
    assert read_secret(str(tmp_path / "t"), "f") == b"tok"


def test_roles_need_distinct_tokens(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("same")
    cfg = AuthConfig(token_files={"rollout": str(tmp_path / "t"), "trainer": str(tmp_path / "t")})
    with pytest.raises(ValueError, match="each role needs its own token"):
        load_tokens(cfg)


@pytest.mark.parametrize("data, key", [
    ({"tls_cert_file": "/c"}, "tls_cert_file, tls_key_file"),
    ({"require_client_cert": True}, "require_client_cert"),
    ({"token_files": {"admin": "/t"}}, "token_files.admin"),
    ({"token": "inline-secret"}, "token: unknown key"),
])
def test_auth_config_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config(AuthConfig, data)


@pytest.mark.parametrize("data, key", [
    ({"cert_file": "/c"}, "cert_file, key_file"),
    ({"cert_file": "/c", "key_file": "/k"}, "cert_file: mutual TLS needs ca_file"),
])
def test_client_auth_config_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config(ClientAuthConfig, data)


def test_client_auth_reads_token_and_logs_only_a_fingerprint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert ClientAuth.from_config(ClientAuthConfig()) is None
    (tmp_path / "tok").write_text("very-secret-token\n")
    caplog.set_level(logging.DEBUG)
    auth = ClientAuth.from_config(ClientAuthConfig(token_file=str(tmp_path / "tok")))
    assert auth is not None and auth.credentials is None
    assert auth.metadata == (("authorization", "Bearer very-secret-token"),)
    assert "very-secret-token" not in caplog.text and fingerprint("very-secret-token") in caplog.text


def test_interceptor_maps_tokens_to_roles() -> None:
    icpt = RoleTokenInterceptor({"rollout": b"r-tok", "trainer": b"t-tok"})
    assert icpt.role_of(b"Bearer r-tok") == "rollout"
    assert icpt.role_of(b"Bearer t-tok") == "trainer"
    for bad in (b"", b"r-tok", b"Bearer r-to", b"Bearer r-tokk", b"bearer t-tok"):
        assert icpt.role_of(bad) is None
    with pytest.raises(ValueError, match="token_files"):
        RoleTokenInterceptor({})
