"""The committed gRPC stubs must be exactly what `make proto` generates from proto/."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_proto(tmp_path):
    work = tmp_path / "repo"
    (work / "services" / "common").mkdir(parents=True)
    shutil.copytree(ROOT / "proto", work / "proto")
    shutil.copy(ROOT / "scripts" / "gen_proto.sh", work / "gen_proto.sh")
    subprocess.run(["bash", "gen_proto.sh", sys.executable], cwd=work, check=True)
    fresh = work / "services" / "common" / "pb"
    committed = ROOT / "services" / "common" / "pb"
    fresh_files = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    committed_files = sorted(p.relative_to(committed) for p in committed.rglob("*")
                             if p.is_file() and "__pycache__" not in p.parts)
    assert fresh_files == committed_files, "stub file set differs: run `make proto`"
    stale = [str(f) for f in fresh_files if (fresh / f).read_bytes() != (committed / f).read_bytes()]
    assert not stale, f"stale generated stubs (run `make proto`): {stale}"


def test_stubs_import_under_services_not_proto():
    from services.common.pb.r3flow.v1 import routing_pb2, store_pb2, store_pb2_grpc

    assert routing_pb2.RoutedExperts.DESCRIPTOR.full_name == "r3flow.v1.RoutedExperts"
    assert "Append" in store_pb2.DESCRIPTOR.services_by_name["TrajectoryStore"].methods_by_name
    assert hasattr(store_pb2_grpc, "TrajectoryStoreStub")
    assert not (ROOT / "proto" / "__init__.py").exists()
