"""`r3flow local` config: seeds move together, and the chart's store/rollout/trainer sections
reach the child configs over the local preset."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from services.local.config import (
    LocalConfig,
    rollout_config,
    seeded,
    store_config,
    trainer_config,
)
from services.local.tasks import closeness_reward, write_datasets
from trainer.config import TrainerConfig


def test_seed_moves_model_init_data_and_sampling(tmp_path: Path):
    a, b = LocalConfig(seed=0), LocalConfig(seed=3)
    (task_a, model_a), (task_b, model_b) = seeded(a), seeded(b)
    assert (task_b.seed - task_a.seed, model_b.seed - model_a.seed) == (3, 3)
    assert rollout_config(b, tmp_path, tmp_path, worker=1)["engine"]["seed"] == 4
    rl_a, _ = write_datasets(task_a, tmp_path / "a")
    rl_b, _ = write_datasets(task_b, tmp_path / "b")
    assert rl_a.read_text() != rl_b.read_text()
    assert seeded(a)[0] == task_a  # same seed, same data


def test_trainer_section_reaches_a_valid_trainer_config(tmp_path: Path):
    cfg = LocalConfig.model_validate({"trainer": {
        "optim": {"ppo_epochs": 3, "mini_batches": 2, "lr": 2e-3, "clip_grad": 0.5,
                  "weight_decay": 0.1},  # a knob the old flat config could not set
        "loss": {"entropy_coef": 0.01, "clip_high": 0.3},
        "replay": {"agreement_floor": 0.0}}})
    tc = TrainerConfig.model_validate(trainer_config(cfg, tmp_path, tmp_path))
    assert (tc.optim.ppo_epochs, tc.optim.mini_batches, tc.optim.lr) == (3, 2, 2e-3)
    assert (tc.optim.weight_decay, tc.loss.clip_high, tc.replay.agreement_floor) == (0.1, 0.3, 0.0)
    assert TrainerConfig.model_validate(trainer_config(
        LocalConfig(), tmp_path, tmp_path)).replay.agreement_floor == 0.5
    assert (tc.loss.entropy_coef, tc.optim.clip_grad) == (0.01, 0.5)
    assert (tc.data.groups_per_step, tc.run.steps) == (32, 40)  # the preset's, kept
    assert tc.model.dtype == "bf16" and tc.run.launcher == "ray"


def test_max_policy_lag_is_set_once_for_the_store_workers_and_trainer(tmp_path: Path):
    cfg = LocalConfig.model_validate({"store": {"max_policy_lag": 1}})
    assert store_config(cfg, tmp_path)["max_policy_lag"] == 1
    assert rollout_config(cfg, tmp_path, tmp_path, worker=0)["max_policy_lag"] == 1
    assert trainer_config(cfg, tmp_path, tmp_path)["data"]["max_policy_lag"] == 1
    assert trainer_config(LocalConfig(), tmp_path, tmp_path)["data"]["max_policy_lag"] == 3
    with pytest.raises(ValidationError, match=r"trainer.data.max_policy_lag=2 but "
                       r"store.max_policy_lag=1: leave it unset"):
        LocalConfig.model_validate({"store": {"max_policy_lag": 1},
                                    "trainer": {"data": {"max_policy_lag": 2}}})


def test_a_bad_section_key_is_named_with_its_section():
    from services.common.config import ConfigError, build_config

    for data, needle in [({"trainer": {"optim": {"lr": -1}}}, "config: trainer.optim.lr: "),
                         ({"rollout": {"sampling": {"zz": 1}}},
                          "config: rollout.sampling.zz: unknown key"),
                         ({"store": {"max_policy_lag": -1}}, "config: store.max_policy_lag: "),
                         ({"trainer": {"run": {"steps": 0}}}, "config: trainer.run.steps: r3flow "
                          "local runs a fixed number")]:
        with pytest.raises(ConfigError) as e:
            build_config(LocalConfig, data)
        assert str(e.value).startswith(needle), (data, str(e.value))


def test_an_old_flat_key_names_where_it_went():
    with pytest.raises(ValidationError, match=r"grpo.lr is trainer.optim.lr now; "
                       r"engine.max_num_seqs is rollout.engine.max_num_seqs now"):
        LocalConfig.model_validate({"grpo": {"lr": 1e-3}, "engine": {"max_num_seqs": 8}})
    with pytest.raises(ValidationError, match=r"replay is trainer.replay.mode now"):
        LocalConfig.model_validate({"replay": "off"})


def test_closeness_reward_ranks_wrong_answers():
    assert closeness_reward(" 12", "12") == 1.0
    assert 1.0 > closeness_reward("13", "12") > closeness_reward("15", "12") > 0.0
    assert closeness_reward("x", "12") == 0.0 and closeness_reward("", "12") == 0.0


def test_step_hooks_and_linger_reach_the_trainer(tmp_path: Path):
    spike = {"path": "tests.support.lr_spike:TimedLrSpike",
             "options": {"after_s": 70.0, "factor": 50.0}}
    cfg = LocalConfig.model_validate({"trainer": {"hooks": [spike, "json:dumps"],
                                                  "run": {"metrics_linger_s": 90.0}}})
    tc = TrainerConfig.model_validate(trainer_config(cfg, tmp_path, tmp_path))
    assert [h.model_dump() for h in tc.hooks] == [spike, {"path": "json:dumps", "options": {}}]
    assert tc.run.metrics_linger_s == 90.0
    off = TrainerConfig.model_validate(trainer_config(LocalConfig(), tmp_path, tmp_path))
    assert (off.hooks, off.run.metrics_linger_s) == ([], 5.0)


def test_stop_on_alert_is_one_of_the_chart_alerts():
    assert LocalConfig().stop_on_alert is None
    ok = LocalConfig.model_validate({"stop_on_alert": "R3flowPpoKlSpike"})
    assert ok.stop_on_alert == "R3flowPpoKlSpike"
    with pytest.raises(ValidationError, match=r"stop_on_alert[\s\S]*'PpoKlSpike' is not an "
                       r"alert of the chart's rules: R3flowPpoKlSpike, R3flowKlRefSpike"):
        LocalConfig.model_validate({"stop_on_alert": "PpoKlSpike"})
    with pytest.raises(ValidationError, match="stop_on_alert 'R3flowPpoKlSpike' needs "
                       "prometheus: true"):
        LocalConfig.model_validate({"stop_on_alert": "R3flowPpoKlSpike", "prometheus": False})


def test_backlog_budget_counts_what_a_trajectory_holds(tmp_path: Path):
    """Prompt "9+9=" (4 tokens) + answer "18" + EOS: 7 tokens, so the store's token budget
    holds backlog_steps optimizer steps, not twice as many (which outran max_policy_lag)."""
    cfg = LocalConfig.model_validate({"trainer": {"data": {"groups_per_step": 16}},
                                      "backlog_steps": 2})
    assert store_config(cfg, tmp_path)["max_backlog_tokens"] == 2 * 16 * 8 * 7
    wide = LocalConfig.model_validate({"task": {"max_operand": 99}, "rollout": {"sampling": {"max_tokens": 2}}})
    assert store_config(wide, tmp_path)["max_backlog_tokens"] == 2 * 32 * 8 * (6 + 2)


def test_gpu_config_file_reaches_the_rollout_and_trainer_configs(tmp_path: Path):
    from services.common.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(LocalConfig, root / "configs" / "local-gpu-h200.yaml",
                      {"trainer.replay.mode": "off"})
    engine = rollout_config(cfg, tmp_path, tmp_path, worker=0)["engine"]
    assert (engine["enforce_eager"], engine["gpu_memory_utilization"]) == (False, 0.35)
    assert engine["max_num_seqs"] == 64 and engine["dtype"] == "bfloat16"
    tc = TrainerConfig.model_validate(trainer_config(cfg, tmp_path, tmp_path))
    assert (tc.run.launcher, tc.run.checkpoint_every, tc.replay.mode) == ("local", 1000, "off")
    assert (tc.replay.compare_off_every, tc.data.max_policy_lag) == (1, 0)
    # the CPU default is unchanged: eager, a checkpoint every step
    cpu = LocalConfig()
    assert rollout_config(cpu, tmp_path, tmp_path, worker=0)["engine"]["enforce_eager"] is True
    assert trainer_config(cpu, tmp_path, tmp_path)["run"]["checkpoint_every"] == 1
