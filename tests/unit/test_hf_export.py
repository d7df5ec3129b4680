"""HF exports (trainer.hf_export): a complete directory behind `latest` at every moment, an
atomic symlink swap, retention that never removes what `latest` names, crash leftovers cleaned."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from trainer.hf_export import INDEX, HFExport, shard_names


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (d / "tokenizer.json").write_text("{}")
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "model.safetensors").write_bytes(b"base weights: never copied")
    (d / "model.safetensors.index.json").write_text("{}")
    return d


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((4, 4), float(step * 10 + i)) for i in range(5)}


def _names(exp: HFExport) -> list[str]:
    return sorted(p.name for p in exp.root.iterdir())


def _read(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / INDEX).read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out |= load_file(str(path / shard))
    assert set(out) == set(index["weight_map"])
    return out


def test_writes_shards_index_and_model_files_then_points_latest(tmp_path, model_dir):
    exp = HFExport(tmp_path / "run", model_dir, keep=0, max_shard_bytes=2 * 64)
    path = exp.write(_weights(3), step=3)
    assert path.name == "step-3" and exp.latest() == path
    assert os.readlink(exp.root / "latest") == "step-3"  # relative: any mount point works
    files = sorted(p.name for p in path.iterdir())
    assert files == sorted([INDEX, "chat_template.jinja", "config.json", "tokenizer.json",
                            "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                            "model-00003-of-00003.safetensors"])
    got = _read(exp.root / "latest")
    for k, v in _weights(3).items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0)
    index = json.loads((path / INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 16 * 4
    assert not any(n.startswith(".") for n in _names(exp))  # no temporary left behind


def test_shards_respect_the_size_limit_and_keep_big_tensors_whole():
    w = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(1)}
    assert shard_names(w, 80) == [["a", "b"], ["big"], ["c"]]


def test_retention_keeps_the_newest_n_and_never_latest(tmp_path, model_dir):
    exp = HFExport(tmp_path / "run", model_dir, keep=2)
    for step in (1, 2, 3, 4):
        exp.write(_weights(step), step)
    assert _names(exp) == ["latest", "step-3", "step-4"]
    # A resume from an older checkpoint re-exports an earlier step: latest names it and it stays,
    # although it is not among the two newest step numbers (those stay until re-exported).
    exp.write(_weights(2), step=2)
    assert exp.latest().name == "step-2"
    assert _names(exp) == ["latest", "step-2", "step-3", "step-4"]
    torch.testing.assert_close(_read(exp.root / "latest")["w0"], _weights(2)["w0"])


def test_keep_zero_keeps_everything(tmp_path, model_dir):
    exp = HFExport(tmp_path / "run", model_dir, keep=0)
    for step in (1, 2, 3):
        exp.write(_weights(step), step)
    assert _names(exp) == ["latest", "step-1", "step-2", "step-3"]


def test_reexport_of_the_same_step_replaces_it(tmp_path, model_dir):
    exp = HFExport(tmp_path / "run", model_dir, keep=2)
    exp.write(_weights(1), step=5)
    exp.write(_weights(2), step=5)
    assert _names(exp) == ["latest", "step-5"]
    torch.testing.assert_close(_read(exp.latest())["w1"], _weights(2)["w1"])


def test_a_crashed_write_never_moves_latest_and_is_cleaned_up(tmp_path, model_dir, monkeypatch):
    exp = HFExport(tmp_path / "run", model_dir, keep=2)
    exp.write(_weights(1), step=1)

    def crash(*_a, **_k):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(HFExport, "_copy_model_files", crash)
        with pytest.raises(OSError, match="disk full"):
            exp.write(_weights(2), step=2)
    assert exp.latest().name == "step-1"  # readers still see the previous, complete export
    assert ".tmp-step-2" in _names(exp)
    (exp.root / ".deleting-step-0").mkdir()  # a crash mid-delete
    exp.write(_weights(3), step=3)
    assert _names(exp) == ["latest", "step-1", "step-3"]


def test_latest_swap_replaces_a_stale_temporary_link(tmp_path, model_dir):
    exp = HFExport(tmp_path / "run", model_dir)
    exp.root.mkdir(parents=True)
    os.symlink("nowhere", exp.root / ".tmp-latest")  # left by a crash between symlink and rename
    exp.write(_weights(1), step=1)
    assert exp.latest().name == "step-1" and not (exp.root / ".tmp-latest").is_symlink()


def test_model_dir_without_config_is_refused(tmp_path):
    exp = HFExport(tmp_path / "run", tmp_path / "missing")
    with pytest.raises(ValueError, match="model_dir"):
        exp.write(_weights(1), step=1)


def test_negative_keep_is_refused(tmp_path, model_dir):
    with pytest.raises(ValueError, match="run.hf_keep"):
        HFExport(tmp_path / "run", model_dir, keep=-1)


@pytest.mark.parametrize(("every", "steps", "want"), [(2, 5, [2, 4, 5]), (2, 4, [2, 4]),
                                                       (0, 3, [])])
def test_loop_exports_every_n_steps_after_the_checkpoint_and_at_the_end(tmp_path, every, steps,
                                                                         want):
    from tests.support.fake_loop import FakeRanks, FakeStore, pulled_group
    from trainer.config import TrainerConfig
    from trainer.loop.loop import TrainLoop

    cfg = TrainerConfig(data={"groups_per_step": 2},
                        run={"run_dir": str(tmp_path), "checkpoint_every": 1,
                             "hf_export_every": every})
    ranks = FakeRanks(2)
    TrainLoop(cfg, ranks, FakeStore([pulled_group(i) for i in range(2 * steps)])).run(steps)
    exports = [(i, args) for i, (m, args) in enumerate(ranks.calls) if m == "export_hf_dir"]
    assert [args for _, args in exports] == [[(s,), (s,)] for s in want]  # every rank joins
    for i, _ in exports:  # right after the checkpoint of the same weights
        assert ranks.calls[i - 1][0] == "save"
