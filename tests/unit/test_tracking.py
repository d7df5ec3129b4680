"""Experiment tracking (trainer.loop.tracking): every run folder gets TensorBoard event files of
its step metrics, read back here frame by frame (CRC-checked); W&B and MLflow are optional and
name their missing package."""

from __future__ import annotations

import json
import struct
import sys

import pytest

from services.common.config import ConfigError, build_config
from tests.support.fake_loop import FakeRanks, FakeStore, loop_config, pulled_group
from trainer.config import TrainerConfig
from trainer.loop.eval_feed import EvalFeed, flat
from trainer.loop.loop import TrainLoop
from trainer.loop.tb_events import Event, EventWriter, crc32c, frame, read_records, read_scalars
from trainer.loop.tracking import TB_DIR, open_trackers, scalars_of


def test_crc32c_is_castagnolis() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(b"") == 0


def test_a_frame_is_length_crc_record_crc() -> None:
    got = frame(b"abc")
    assert struct.unpack("<Q", got[:8])[0] == 3 and got[12:15] == b"abc" and len(got) == 19


def test_event_file_holds_the_version_then_one_event_per_step(tmp_path) -> None:
    w = EventWriter(tmp_path)
    w.scalars(1, {"reward_mean": 0.25, "grad_norm": 2.0})
    w.scalars(2, {"reward_mean": 0.5})
    assert w.path.name.startswith("events.out.tfevents.")
    first = Event.FromString(read_records(w.path)[0])
    assert first.file_version == "brain.Event:2"
    assert read_scalars(tmp_path) == {"reward_mean": [(1, 0.25), (2, 0.5)], "grad_norm": [(1, 2.0)]}
    w.path.write_bytes(w.path.read_bytes()[:-1])  # a cut last record is refused
    with pytest.raises(ValueError, match="bad record"):
        read_records(w.path)


def test_scalars_of_a_step_flatten_dicts_and_drop_the_rest() -> None:
    got = scalars_of({"a": 1, "b": 0.5, "replay": "r3", "skipped": True, "x": None,
                      "nan": float("nan"), "by_layer": {3: 0.9, "all": 1}})
    assert got == {"a": 1.0, "b": 0.5, "by_layer/3": 0.9, "by_layer/all": 1.0}


def test_every_run_folder_gets_the_step_metrics_as_tensorboard_events(tmp_path) -> None:
    store = FakeStore([pulled_group(i) for i in range(6)])
    history = TrainLoop(loop_config(tmp_path), FakeRanks(2), store).run(3)
    got = read_scalars(tmp_path / TB_DIR)
    assert [s for s, _ in got["grad_norm"]] == [1, 2, 3]
    assert [v for _, v in got["grad_norm"]] == [h["grad_norm"] for h in history] == [1.5] * 3
    assert got["routing_agreement_by_layer/1"] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert got["learning_rate"][0] == (1, pytest.approx(TrainerConfig().optim.lr))


def test_tensorboard_can_be_turned_off(tmp_path) -> None:
    cfg = build_config(TrainerConfig, {"tracking": {"tensorboard": False}})
    assert open_trackers(cfg.tracking, tmp_path) == []
    assert not (tmp_path / TB_DIR).exists()
    with pytest.raises(ConfigError, match=r"tracking\.wandb_mode"):
        build_config(TrainerConfig, {"tracking": {"wandb_mode": "cloud"}})


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_an_optional_tracker_without_its_package_names_it(tmp_path, monkeypatch, package) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # an image without it: import fails
    cfg = build_config(TrainerConfig, {"tracking": {package: True}})
    with pytest.raises(ValueError, match=rf"^tracking\.{package}: needs the `{package}` package"):
        open_trackers(cfg.tracking, tmp_path)


def test_mlflow_file_store(tmp_path) -> None:
    mlflow = pytest.importorskip("mlflow")
    cfg = build_config(TrainerConfig, {"tracking": {"mlflow": True, "tensorboard": False}})
    (t,) = open_trackers(cfg.tracking, tmp_path)
    t.log(1, {"reward_mean": 0.5, "groups_quarantined_by_reason/a:b": 1.0})
    t.log(2, {"reward_mean": 0.75})
    t.close()
    client = mlflow.tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("r3flow").experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert run.data.metrics["groups_quarantined_by_reason/a_b"] == 1.0  # `:` is not allowed


def test_wandb_offline(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = build_config(TrainerConfig, {"tracking": {"wandb": True, "tensorboard": False}})
    (t,) = open_trackers(cfg.tracking, tmp_path)
    t.log(1, {"reward_mean": 0.5})
    t.log(2, {"reward_mean": 0.75})
    t.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # `wandb sync` uploads it
    data = run.read_bytes()  # history records keep keys and JSON values as plain bytes
    assert b"reward_mean" in data and b"0.75" in data


def test_eval_rows_reach_the_step_log_and_tensorboard(tmp_path) -> None:
    """run.eval_log: the rows the rollout workers' evals append (services.rollout.evaluation)
    go into the next step's record, each once; a row still being written waits."""
    evals = tmp_path / "eval_log.jsonl"
    row = {"policy_version": 0, "source": "gsm8k", "accuracy": 0.25, "prompts": 4,
           "pass_at_k": {"1": 0.2, "4": 0.5}}
    evals.write_text(json.dumps(row) + "\n" + '{"policy_version": 1, "sou')
    cfg = loop_config(tmp_path)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"eval_log": str(evals)})})
    history = TrainLoop(cfg, FakeRanks(1), FakeStore([pulled_group(i) for i in range(4)])).run(2)
    assert history[0]["eval/gsm8k/accuracy"] == 0.25 and history[0]["eval/gsm8k/pass@4"] == 0.5
    assert "eval/gsm8k/accuracy" not in history[1]  # nothing new by step 2
    logged = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert logged[0]["eval/gsm8k/policy_version"] == 0
    assert read_scalars(tmp_path / TB_DIR)["eval/gsm8k/accuracy"] == [(1, 0.25)]
    with evals.open("a") as f:
        f.write('rce": "gsm8k", "accuracy": 0.5}\n')
    assert flat(row) == {"eval/gsm8k/policy_version": 0, "eval/gsm8k/accuracy": 0.25,
                         "eval/gsm8k/pass@1": 0.2, "eval/gsm8k/pass@4": 0.5}
    feed = EvalFeed(str(evals))
    assert feed.new_metrics()["eval/gsm8k/accuracy"] == 0.5  # the later row wins
    assert feed.new_metrics() == {}


def test_tensorboards_own_reader_loads_a_run_folders_events(tmp_path) -> None:
    """The files are what TensorBoard reads: its own EventAccumulator (the tensorboard package,
    requirements/cpu.lock) loads every step's scalars from the loop's run folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = FakeStore([pulled_group(i) for i in range(6)])
    history = TrainLoop(loop_config(tmp_path), FakeRanks(2), store).run(3)
    acc = EventAccumulator(str(tmp_path / TB_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    assert {"grad_norm", "learning_rate", "routing_agreement_by_layer/1"} <= \
        set(acc.Tags()["scalars"])
    got = [(e.step, e.value) for e in acc.Scalars("grad_norm")]
    assert got == [(i + 1, pytest.approx(h["grad_norm"])) for i, h in enumerate(history)]
