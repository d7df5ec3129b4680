"""Access control with a real store process: mutual TLS, per-role bearer tokens, a Redis password.

One store (mTLS + rollout/trainer tokens) over one password-protected embedded redis-server;
each rejection is shown with a real client, and the store's log is checked for secrets.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from store_fixtures import REPO, StoreProcess
from tls_fixtures import Pki, make_pki

from services.common.auth import ClientAuth, ClientAuthConfig
from services.common.pb.r3flow.v1 import store_pb2
from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group

ROLLOUT_TOKEN = "rollout-token-5f0c1e9a7d"
TRAINER_TOKEN = "trainer-token-b84e2a61c3"
REDIS_PASSWORD = "redis-pass-93d7a0e4"


class AuthedStore(StoreProcess):
    """A store process that is waited for through an authenticated TLS client."""

    def start(self, timeout_s: float = 60.0, ready_auth: ClientAuth | None = None) -> AuthedStore:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "REDIS_URL": str(self.redis_url)}
        argv = [*self.entry, "--config", str(self.config_path),
                "--listen", self.address, "--metrics-port", str(self.metrics_port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=log)
        with StoreClient(self.address, auth=ready_auth) as client:
            try:
                client.wait_ready(timeout_s)
            except TimeoutError:
                self.kill()
                raise RuntimeError(f"store did not start: {self.log_path.read_text()[-2000:]}") from None
        return self


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("secrets")
    (d / "rollout.token").write_text(ROLLOUT_TOKEN + "\n")
    (d / "trainer.token").write_text(TRAINER_TOKEN + "\n")
    (d / "redis.password").write_text(REDIS_PASSWORD)
    return d


@pytest.fixture(scope="module")
def pki(secrets_dir: Path) -> Pki:
    return make_pki(secrets_dir / "pki")


def client_auth(pki: Pki, secrets_dir: Path, role: str | None, *, ca: Path | None = None,
                client_cert: bool = True) -> ClientAuth:
    cfg = ClientAuthConfig(
        token_file=str(secrets_dir / f"{role}.token") if role else None,
        ca_file=str(ca or pki.ca),
        cert_file=str(pki.client_cert) if client_cert else None,
        key_file=str(pki.client_key) if client_cert else None)
    auth = ClientAuth.from_config(cfg)
    assert auth is not None
    return auth


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"), password=REDIS_PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secure_store(locked_redis: EmbeddedRedis, pki: Pki, secrets_dir: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthedStore]:
    auth = {"tls_cert_file": str(pki.server_cert), "tls_key_file": str(pki.server_key),
            "tls_ca_file": str(pki.ca), "require_client_cert": True,
            "token_files": {"rollout": str(secrets_dir / "rollout.token"),
                            "trainer": str(secrets_dir / "trainer.token")}}
    # The URL carries no password: the store takes it from redis_password_file.
    proc = AuthedStore(locked_redis.url, tmp_path_factory.mktemp("store"), auth=auth,
                       redis_password_file=str(secrets_dir / "redis.password"))
    proc.start(ready_auth=client_auth(pki, secrets_dir, None))
    yield proc
    proc.stop()


def _code(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_redis_refuses_clients_without_the_password(locked_redis: EmbeddedRedis) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=locked_redis.port).ping()
    assert redis.Redis(port=locked_redis.port, password=REDIS_PASSWORD).ping()


def test_no_token_is_unauthenticated(secure_store: AuthedStore, pki: Pki,
                                     secrets_dir: Path) -> None:
    with StoreClient(secure_store.address, max_retries=0,
                     auth=client_auth(pki, secrets_dir, None)) as c:
        assert _code(c.stats) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: c.pull("t", 1)) == grpc.StatusCode.UNAUTHENTICATED
        c.wait_ready(5)  # grpc.health.v1 stays open for probes


def test_wrong_token_is_unauthenticated(secure_store: AuthedStore, pki: Pki,
                                        secrets_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.token").write_text(TRAINER_TOKEN + "x")
    cfg = ClientAuthConfig(token_file=str(tmp_path / "bad.token"), ca_file=str(pki.ca),
                           cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    with StoreClient(secure_store.address, max_retries=0,
                     auth=ClientAuth.from_config(cfg)) as c:
        assert _code(c.stats) == grpc.StatusCode.UNAUTHENTICATED


def test_rollout_may_append_but_not_pull(secure_store: AuthedStore, pki: Pki,
                                         secrets_dir: Path) -> None:
    with StoreClient(secure_store.address, max_retries=0,
                     auth=client_auth(pki, secrets_dir, "rollout")) as c:
        assert c.append_trajectories(small_group("auth-g", 2)).accepted > 0
        assert c.register_worker("w0", "h", 1) > 0
        assert c.stats().trajectories_appended >= 2
        assert _code(lambda: c.pull("t", 1)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: c.ack("t", ["x"])) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: c.publish_policy_version(5)) == grpc.StatusCode.PERMISSION_DENIED


def test_trainer_may_pull_but_not_append(secure_store: AuthedStore, pki: Pki,
                                         secrets_dir: Path) -> None:
    with StoreClient(secure_store.address, max_retries=0,
                     auth=client_auth(pki, secrets_dir, "trainer")) as c:
        assert _code(lambda: c.append_trajectories(small_group("auth-t", 2))) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: c.register_worker("w1", "h", 1)) == \
            grpc.StatusCode.PERMISSION_DENIED
        groups = c.pull("trainer-0", 1, wait_ms=5000)
        assert [g.group_id for g in groups] == ["auth-g"]
        assert c.ack("trainer-0", [groups[0].delivery_id]) == 1
        assert c.publish_policy_version(1) == 1
        assert [w.worker_id for w in c.list_workers()] == ["w0"]
        c.publish_weight_sync(store_pb2.WeightSyncPlan(version=1))


def test_tls_without_the_ca_fails(secure_store: AuthedStore, pki: Pki, secrets_dir: Path,
                                  tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other", ca_name="some-other-ca")
    with StoreClient(secure_store.address, max_retries=0, timeout_s=5,
                     auth=client_auth(pki, secrets_dir, "trainer", ca=other.ca)) as c:
        assert _code(c.stats) == grpc.StatusCode.UNAVAILABLE
    with StoreClient(secure_store.address, max_retries=0, timeout_s=5) as plaintext:
        assert _code(plaintext.stats) == grpc.StatusCode.UNAVAILABLE


def test_mtls_without_client_cert_fails(secure_store: AuthedStore, pki: Pki,
                                        secrets_dir: Path) -> None:
    with StoreClient(secure_store.address, max_retries=0, timeout_s=5,
                     auth=client_auth(pki, secrets_dir, "trainer", client_cert=False)) as c:
        assert _code(c.stats) == grpc.StatusCode.UNAVAILABLE


def test_secrets_never_logged(secure_store: AuthedStore, pki: Pki, secrets_dir: Path,
                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG")
    client_auth(pki, secrets_dir, "trainer")  # the client side logs a fingerprint too
    store_log = secure_store.log_path.read_text()
    key_pem = pki.server_key.read_text().splitlines()[1]
    assert "sha256:" in store_log and "mutual TLS" in store_log
    for text in (store_log, caplog.text):
        for secret in (ROLLOUT_TOKEN, TRAINER_TOKEN, REDIS_PASSWORD, key_pem):
            assert secret not in text


def test_rollout_and_trainer_configs_carry_their_store_auth(secure_store: AuthedStore, pki: Pki,
                                                             secrets_dir: Path) -> None:
    from services.rollout.app import _open_store
    from services.rollout.config import RolloutConfig
    from trainer.config import DataConfig

    def section(role: str) -> dict:
        return {"token_file": str(secrets_dir / f"{role}.token"), "ca_file": str(pki.ca),
                "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)}

    rollout = RolloutConfig.model_validate({
        "engine": {"model": "m"}, "dataset": "d.jsonl", "store": secure_store.address,
        "store_max_retries": 0, "store_auth": section("rollout")})
    with _open_store(rollout) as client:
        assert client.register_worker("w-cfg", "h", 1) > 0
        assert _code(lambda: client.pull("t", 1)) == grpc.StatusCode.PERMISSION_DENIED
    data = DataConfig.model_validate({"store": secure_store.address,
                                      "store_auth": section("trainer")})
    with StoreClient(data.store, max_retries=0,
                     auth=ClientAuth.from_config(data.store_auth)) as client:
        assert "w-cfg" in [w.worker_id for w in client.list_workers()]
