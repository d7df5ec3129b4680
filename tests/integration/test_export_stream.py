"""The streamed HF export (TrainBackend.iter_hf_weights, trainer.megatron.export_stream): on 2
megatron ranks over gloo (EP2, PP2), the tensors rank 0 receives equal today's gathered export
(`export_hf_state_dict`) name for name and byte for byte, and the non-sender rank allocates no
model-sized buffer while streaming; the packed form the weight push takes (whole chunks, experts
mapped once) equals it too, also after the weights changed in place or moved. The lazy load (trainer.megatron.lazy_checkpoint) of a sharded
checkpoint (several files + index.json) gives each rank the weights the whole-checkpoint path
gives it while reading only its own tensors.

Memory is measured, not read off the code: each rank resets its peak resident set
(/proc/self/clear_refs = 5) and reads VmHWM - VmRSS after the stream; the same reading around
today's export (which gathers the whole model on every rank) shows that the measure sees a
model-sized buffer. Each rank is this file run as a script.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from services.common.weight_sync import buckets as bk
from tests.support.ranks import run_script_ranks

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256 << 10  # 256 KiB chunks: the model is ~40 MiB in fp32
LAYOUTS = {"ep2": {"expert_parallel": 2}, "pp2": {"pipeline_parallel": 2},
           "ep2_grouped": {"expert_parallel": 2, "experts": "grouped"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("stream") / "tiny", TinyMoeConfig(
        hidden_size=256, num_layers=4, first_k_dense=1, num_experts=16,
        moe_intermediate_size=128, intermediate_size=512))


def write_sharded(src: Path, dst: Path, shard_bytes: int) -> Path:
    """`src`'s checkpoint as several safetensors files plus model.safetensors.index.json (the
    layout save_pretrained(max_shard_size=...) writes), with its config and tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    sd = load_file(str(src / "model.safetensors"))
    shards: list[dict] = [{}]
    for name in sorted(sd):
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) > shard_bytes:
            shards.append({})
        shards[-1][name] = sd[name]
    weight_map = {}
    for i, part in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
    (dst / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.nbytes for t in sd.values())}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, model_dir):
    """Both layouts, one after the other, in one pair of rank processes: per layout, each
    rank's report."""
    tmp = tmp_path_factory.mktemp("ranks")
    sharded = write_sharded(Path(model_dir), tmp / "sharded", 1 << 20)
    return run_script_ranks(__file__, tmp, [str(model_dir), str(sharded)], timeout=240,
                            name="r{rank}.json")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stream_equals_export_and_stays_small(ranks, layout):
    r0, r1 = (r[layout] for r in ranks)
    assert r0["names_equal"] and r0["order_equal"] and not r0["mismatched"], r0["mismatched"]
    assert r0["packed"] == {"built": True, "updated": True, "moved": True}, r0["packed"]
    model = r0["model_bytes"]
    # the control: today's export raises the peak of every rank by about the model
    assert r1["export_extra"] > model // 2, r1
    # the stream: the non-sender rank never holds more than a few chunks beyond its unit
    # (measured from a trimmed heap: 1.7-3.1 MB here, against ~45 MB for the export)
    assert r1["stream_extra"] < model // 5, r1
    assert r1["peak_inflight"] <= 3 * CHUNK, r1  # depth 2 in flight + the one being packed
    assert r0["stream_extra"] < model // 4, r0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_checkpoint_load_reads_only_each_ranks_tensors(ranks, layout):
    loads = [r[layout]["load"] for r in ranks]
    total = loads[0]["checkpoint_bytes"]
    assert loads[0]["files"] > 3
    for load in loads:
        assert load["equal"], load  # the same weights as the whole-checkpoint loader
        # EP2: all attention + half the experts; PP2: half the layers (+ embedding or head)
        assert load["bytes_read"] < 0.75 * total, load
    assert sum(load["bytes_read"] for load in loads) >= total * 0.95


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _extra_bytes(fn):
    """(fn(), peak resident set during fn minus the resident set before, in bytes)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # freed heap back to the OS: earlier work cannot hide a peak
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    out = fn()
    return out, (_status_kib("VmHWM") - before) << 10


def _load_check(built, sharded: str) -> dict:
    """Reload `built` from the sharded checkpoint lazily; its weights against the whole-
    checkpoint path (every file read, mapped, then sliced), and what the lazy load read."""
    import torch
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from trainer.megatron.grouped_experts import to_layout_of
    from trainer.megatron.hf_mapping import hf_to_megatron
    from trainer.megatron.model import load_hf_weights
    from trainer.megatron.parallel import model_weights, shard_full

    ckpt, rss_extra = _extra_bytes(lambda: load_hf_weights(built, sharded))
    full: dict = {}
    files = sorted(Path(sharded).glob("*.safetensors"))
    for f in files:
        full |= load_file(str(f))
    want = shard_full(built.module, hf_to_megatron(
        full, built.arch, ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size()), built.config.gated_linear_unit)
    have = model_weights(built.module)
    want = to_layout_of(want, set(have))  # grouped experts: stacked
    return {"bytes_read": ckpt.bytes_read, "rss_extra": rss_extra, "files": len(files),
            "checkpoint_bytes": sum(t.nbytes for t in full.values()),
            "equal": set(want) == set(have) and all(torch.equal(have[k], want[k].to(have[k]))
                                                    for k in want)}


def _layout(model_dir: str, sharded: str, layout: str) -> dict:
    from services.common.weight_sync.digest import tensor_digest
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    cfg = TrainerConfig(model_dir=model_dir, model=LAYOUTS[layout], data={"micro_batch_size": 2})
    backend = make_trainer(cfg).backend
    stream = backend.iter_hf_weights(sender=0, chunk_bytes=CHUNK)
    # the sender keeps digests only (what it received), so its own reading stays small too
    got, stream_extra = _extra_bytes(lambda: [(n, tensor_digest(t)) for n, t in stream])
    ref, export_extra = _extra_bytes(backend.export_hf_state_dict)
    want = [(n, tensor_digest(t)) for n, t in ref.items()]
    report = {"stream_extra": stream_extra, "export_extra": export_extra,
              "model_bytes": sum(t.numel() * t.element_size() for t in ref.values()),
              "peak_inflight": stream.peak_inflight,
              "load": _load_check(backend.policy, sharded)}
    packed = _packed_checks(backend, want)
    if os.environ["RANK"] == "0":
        report |= {"names_equal": sorted(n for n, _ in got) == sorted(ref),
                   "order_equal": [n for n, _ in got] == list(ref),
                   "mismatched": sorted(n for (n, a), (_, b) in zip(sorted(got), sorted(want),
                                                                   strict=True) if a != b),
                   "packed": packed}
    else:
        assert got == [] and packed == {}, "only the sender gets tensors"
    return report


def _packed_checks(backend, want: list) -> dict:
    """The stream as the weight push takes it (whole packed buckets; experts mapped once and
    then reused as views of the parameters): equal to the export three times — as built,
    after an in-place update of every parameter, and after one expert parameter moved to new
    storage (its unit must be mapped afresh)."""
    import torch

    from services.common.weight_sync.digest import tensor_digest
    from trainer.megatron.parallel import model_weights

    def digests() -> list:
        out = []
        for bucket in backend.iter_hf_weights(sender=0, chunk_bytes=CHUNK, wire="float32"):
            assert bucket.buffer.numel() <= CHUNK or len(bucket.entries) == 1
            views = bk.bucket_views(bucket.buffer, list(bucket.entries))
            out += [(e.name, tensor_digest(v)) for e, v in zip(bucket.entries, views,
                                                                strict=True)]
        return out

    def reference() -> list:
        return [(n, tensor_digest(t)) for n, t in backend.export_hf_state_dict().items()]

    runs = {"built": (digests(), want)}
    params = model_weights(backend.policy.module)
    with torch.no_grad():
        for p in params.values():
            p.mul_(-1.5)
    runs["updated"] = (digests(), reference())
    moved = next(p for n, p in params.items() if ".experts." in n)
    with torch.no_grad():
        moved.data = moved.data.clone().add_(1.0)
    runs["moved"] = (digests(), reference())
    if os.environ["RANK"] != "0":
        assert all(got == [] for got, _ in runs.values())
        return {}
    return {k: sorted(got) == sorted(ref) and len(got) == len(ref) for k, (got, ref) in runs.items()}


def _rank(model_dir: str, out: str, sharded: str) -> None:
    import torch
    from megatron.core import parallel_state as ps

    reports = {}
    for layout in sorted(LAYOUTS):
        reports[layout] = _layout(model_dir, sharded, layout)
        torch.distributed.barrier()
        ps.destroy_model_parallel()
    Path(out).write_text(json.dumps(reports))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank(*sys.argv[1:4])
