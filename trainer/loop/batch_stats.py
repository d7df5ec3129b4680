"""What a step trained on, read from its groups (PulledGroup protos) in the loop's process: the
rollout side of the step metrics, a few sample rows for `<run_dir>/samples.jsonl` and the
runtime MFU of the step.

`accuracy` counts a trajectory correct when its reward is at least `data.correct_reward` (the
built-in verifiers score 1 for a right answer and 0 otherwise); response length is the tokens
of every segment (agent turns included); truncated = finished at max_tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from services.common import families
from services.common.errors import UserError
from services.common.pb.r3flow.v1 import trajectory_pb2
from trainer.config import TrainerConfig
from trainer.plan.models import load_model_config

log = logging.getLogger(__name__)

LENGTH = trajectory_pb2.FINISH_REASON_LENGTH
# bf16 dense peak of one device, by a substring of torch.cuda.get_device_name (run.peak_tflops
# overrides; a device not listed, or a CPU, reports no MFU)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0,
               "L40S": 362.0}


def _response_len(t) -> int:  # noqa: ANN001 (a trajectory_pb2.Trajectory)
    return sum(len(s.token_ids) for s in t.segments)


def rollout_stats(groups: Sequence, correct_reward: float) -> dict:
    """Reward mean / std, accuracy, response length mean / max, truncated share and sequence
    tokens (prompt + response) of the trajectories of `groups`; {} for none."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return {}
    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    lengths = np.array([_response_len(t) for t in trajs])
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "accuracy": float((rewards >= correct_reward).mean()),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": int(lengths.max()),
            "truncated_share": float(np.mean([t.finish_reason == LENGTH for t in trajs])),
            "sequence_tokens": int(lengths.sum() + sum(len(t.prompt_token_ids) for t in trajs))}


Decode = Callable[[Sequence[int]], str]


def sample_rows(groups: Sequence, n: int, decode: Decode | None) -> list[dict]:
    """The first trajectory of each of the first `n` groups: prompt, response (text when a
    tokenizer decodes them, else token ids), reward, finish reason, response length."""
    rows = []
    for g in list(groups)[:n]:
        if not g.trajectories:
            continue
        t = g.trajectories[0]
        response = [i for s in t.segments for i in s.token_ids]
        texts = ({"prompt": decode(t.prompt_token_ids), "response": decode(response)}
                 if decode is not None else
                 {"prompt_token_ids": list(t.prompt_token_ids), "response_token_ids": response})
        rows.append({"group_id": g.group_id, "prompt_id": t.prompt_id, **texts,
                     "reward": t.reward, "finish_reason": trajectory_pb2.FinishReason.Name(
                         t.finish_reason).removeprefix("FINISH_REASON_").lower(),
                     "response_length": len(response)})
    return rows


def append_samples(path: Path, step: int, rows: list[dict]) -> None:
    """Append one step's sample rows to the JSONL file."""
    if rows:
        with path.open("a") as f:
            f.writelines(json.dumps({"step": step, **r}) + "\n" for r in rows)


def peak_tflops(configured: float | None) -> float | None:
    """One device's peak (bf16 dense) TFLOP/s: the configured one, else the CUDA device's from
    PEAK_TFLOPS when this process sees one, else None (no MFU)."""
    if configured is not None:
        return configured
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def mfu(active_params: int, tokens: int, passes: float, seconds: float, world: int,
        peak: float | None) -> float | None:
    """Model FLOPs utilisation of a step: 2 x active params x tokens per forward-equivalent pass
    (`passes`: a training pass counts 3, a no-grad pass 1; attention's quadratic term left out)
    over the devices' peak for the step's wall time."""
    if peak is None or seconds <= 0 or not tokens:
        return None
    return 2.0 * active_params * tokens * passes / (seconds * world * peak * 1e12)


class StepStats:
    """The rollout stats, sample rows and MFU of each step, for one run (built by the loop)."""

    def __init__(self, cfg: TrainerConfig, world_size: int) -> None:
        self.cfg, self.world = cfg, world_size
        self.samples_path = Path(cfg.run.run_dir) / "samples.jsonl"
        self.active = _active_params(cfg.model_dir)
        self.peak = peak_tflops(cfg.run.peak_tflops) if self.active else None
        # forward-equivalent passes per step: 3 per training epoch, the old-policy pass, the
        # reference pass when the loss has one
        self.passes = 3 * cfg.optim.ppo_epochs + 1 + int(cfg.loss.uses_reference)
        self._decode: Decode | None = None
        self._decode_loaded = False

    def of(self, step: int, groups: Sequence, metrics: dict) -> dict:
        """The step's rollout stats and MFU (its sample rows appended to samples.jsonl)."""
        stats = rollout_stats(groups, self.cfg.data.correct_reward)
        if self.active and stats:
            stats["mfu"] = mfu(self.active, stats["sequence_tokens"], self.passes,
                               metrics.get("step_seconds") or 0.0, self.world, self.peak)
        if self.cfg.run.sample_rows:
            append_samples(self.samples_path, step,
                           sample_rows(groups, self.cfg.run.sample_rows, self.decoder()))
        return stats

    def decoder(self) -> Decode | None:
        """The model's tokenizer's decode (loaded once), or None without one (token ids then)."""
        if not self._decode_loaded:
            self._decode, self._decode_loaded = _load_decode(self.cfg.model_dir), True
        return self._decode


def _active_params(model_dir: str) -> int | None:
    """Active parameters per token of the model's HF config (None: no model_dir or an
    architecture the planner's estimate does not read: no MFU, with a warning)."""
    if not model_dir:
        return None
    try:
        return families.model_shape(load_model_config(model_dir)).active_params()
    except (UserError, ValueError) as e:
        log.warning("no MFU in the step metrics: %s", e)
        return None


def _load_decode(model_dir: str) -> Decode | None:
    if not model_dir:
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        log.warning("samples.jsonl gets token ids, no text: no tokenizer in %s (%s)", model_dir, e)
        return None
    return lambda ids: str(tok.decode(list(ids), skip_special_tokens=False))
