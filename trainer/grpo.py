"""One GRPO/PPO step, written once over a `TrainBackend` (trainer.backend).

`train_step(samples)`:
  1. group-normalised advantages; micro-batches (the backend cuts them);
  2. old-policy logprob pass (no grad): r3 replays the rollout routing and measures routing
     agreement per (trajectory unit, MoE layer) (RoutingAgreementError below the floor names
     the groups to quarantine), r2 records the policy's own routing, off routes naturally;
     |rollout - trainer| logprob diff is measured. Skipped (loss.skip_old_policy_pass) when
     the batch takes one update: the old policy is then the policy the update starts from, so
     the update pass's own logprobs, detached, are the ratio's denominator, and that pass
     gives the diffs, the TIS weights and (r3) the agreement check before its optimizer step;
     r2 then routes the update with the policy's own routing, which is exactly what its
     recording pass would have recorded (same weights, same tokens) and replayed;
  3. reference pass (kl_coef > 0 or kl_metric) replaying the same routing; KL in reward,
     rollout correction (TIS/MIS) and the off-policy metrics (trainer.losses.corrections);
  4. updates: `optim.ppo_epochs` x `optim.mini_batches` backend updates with the PPO loss,
     normalised over the whole update on every data-parallel rank (trainer.losses.objectives); a
     non-finite loss or gradient on any rank skips the update on every rank (the backends'
     vote point before the optimizer step).
The passes run through trainer.guard.run_pass: a fault one group's data caused (agreement,
replay desync, OOM, non-finite loss) is decided on every rank together and its groups are
quarantined; while no update of the step was applied the step is redone without them. A group
with a non-finite rollout logprob is refused before the first pass. The step's metrics say what
happened: `dropped` (group -> reason), `updates_skipped` / `updates_rerun` (attempts a fault
abandoned / of those, the ones redone without the quarantined groups), and
`routing_agreement_min` / `_worst` / `_worst_layer` are the worst cell of every pass the step
ran (the faulting pass's, with the quarantined group, not only the re-run's); layers are the
model's layer numbers (`routing_agreement_by_layer` too).
Legend: B batch rows, S sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from trainer.guard import Fault, gather, nonfinite_groups, nonfinite_logprob_groups, run_pass
from trainer.losses.corrections import (
    apply_rollout_correction,
    diff_by_staleness,
    kl_in_reward,
    set_advantages,
    staleness_metrics,
)
from trainer.losses.logprobs import logprob_entropy
from trainer.losses.loss import (
    logprob_diff,
    mismatch_sums,
    policy_logprobs,
    ppo_terms,
    sft_loss,
    token_logprobs,
)
from trainer.losses.objectives import (
    UpdateNorm,
    aggregate,
    rollout_weights,
    sequence_index,
    update_norm,
)
from trainer.protocol import TrainBackend
from trainer.replay import ReplayMode
from trainer.samples.alignment import LayerMap
from trainer.samples.batch import MicroBatch, Sample, response_logprobs, update_schedule

PPO_SUMS = ("ppo_kl", "kl_ref", "clipped", "clipped_dual", "entropy")


def diff_metrics(mbs: Sequence[MicroBatch], lps: Sequence[torch.Tensor], suffix: str) -> dict:
    """Token-weighted mean and max |rollout - trainer| logprob over the trained tokens, the k3
    KL(rollout || trainer) per token (`mismatch_kl`, the figure the dashboards and docs name)
    and the share of tokens with |diff| > LOGPROB_DIFF_FAR (None on a rank with none: filler
    micro-batches only)."""
    keys = [f"logprob_diff_mean{suffix}", f"logprob_diff_max{suffix}", f"mismatch_kl{suffix}",
            f"logprob_diff_far_share{suffix}"]
    diffs = [logprob_diff(mb.old_logprobs_BS, lp, mb.loss_mask_BS)
             for mb, lp in zip(mbs, lps, strict=True)]
    sums = np.array([mismatch_sums(mb.old_logprobs_BS, lp, mb.loss_mask_BS)
                     for mb, lp in zip(mbs, lps, strict=True)]).reshape(-1, 2).sum(axis=0)
    w = np.array([mb.num_tokens for mb in mbs], dtype=np.float64)
    if not w.sum():
        return dict.fromkeys(keys)
    return dict(zip(keys, (float(np.dot([d[0] for d in diffs], w) / w.sum()),
                           max(d[1] for d in diffs), float(sums[0] / w.sum()),
                           float(sums[1] / w.sum())), strict=True))


def _agreement_min(m: dict[str, Any]) -> float:
    """Sort key of a pass's metrics by their worst agreement cell (none: after every cell)."""
    return m.get("routing_agreement_min", 2.0)


def _old_lps(mbs: Sequence[MicroBatch]) -> list[torch.Tensor]:
    """The trainer's old-policy logprobs of each micro-batch (set by the pass that made them)."""
    out = [mb.train_old_lp for mb in mbs]
    assert all(lp is not None for lp in out), "old-policy logprobs first"
    return out  # type: ignore[return-value]


def _tokens(mbs: Sequence[MicroBatch]) -> float:
    return float(sum(mb.num_tokens for mb in mbs))


class GRPOStep:
    """Advantages, old-policy and reference passes, the update schedule, agreement and metrics
    of one rank, over `backend`."""

    def __init__(self, backend: TrainBackend) -> None:
        self.backend, self.cfg = backend, backend.cfg
        self.policy_version = 0
        self._layer_maps: dict[tuple[int, ...], LayerMap] = {}

    def layer_map(self, engine_layer_ids: Sequence[int]) -> LayerMap:
        """Engine layer columns -> this model's MoE layers (checked against the model)."""
        key = tuple(int(x) for x in engine_layer_ids)
        if key not in self._layer_maps:
            self._layer_maps[key] = LayerMap.build(self.backend.moe_layers, key)
        return self._layer_maps[key]

    # ------------------------------------------------------------------ passes
    @torch.no_grad()
    def compute_logprobs(self, mbs: Sequence[MicroBatch], replay: ReplayMode | str,
                         reference: bool = False) -> list[torch.Tensor]:
        """Per micro-batch [B, S] logprobs of the labels (no grad); r2 records routing."""
        mode, b = ReplayMode(replay), self.backend
        with b.no_grad_pass(mbs, mode, reference):
            return [self._logprobs(b.logits(mb, mode, reference), mb) for mb in mbs]

    def _logprobs(self, logits_BSV: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[B, S] logprobs of the labels: the Triton kernels where the update's loss runs them
        (loss.logprob_kernel; the same function in both passes), else torch.log_softmax."""
        if self.cfg.loss.triton_for(logits_BSV):
            return logprob_entropy(logits_BSV, mb.labels_BS, mb.temperature_BS,
                                   kernel="triton")[0]
        return token_logprobs(logits_BSV, mb.labels_BS, mb.temperature_BS)

    def sample_logprobs(self, samples: Sequence[Sample], replay: ReplayMode | str
                        ) -> list[np.ndarray]:
        """Trainer logprob of every response token of each sample (input order), no grad."""
        mbs = self.backend.microbatches(samples)
        by_id = {}
        for mb, lp in zip(mbs, self.compute_logprobs(mbs, replay), strict=True):
            for s, resp in zip(mb.samples, response_logprobs(mb, lp), strict=True):
                by_id[id(s)] = resp
        return [by_id[id(s)] for s in samples]

    def prepare(self, samples: Sequence[Sample]) -> list[MicroBatch]:
        """Advantages (GRPO, per group, of the shaped rewards) and the backend's micro-batches."""
        set_advantages(samples, self.cfg.loss)
        return self.backend.microbatches(samples)

    def old_policy_pass(self, mbs: Sequence[MicroBatch], mode: ReplayMode,
                        skip: bool = False) -> dict:
        """Old-policy logprobs (+ agreement in r3), reference logprobs; returns metrics. With
        `skip` only the reference (and compare_off) passes run: the update pass measures the
        rest (`after_skipped_pass`)."""
        t0 = time.perf_counter()
        if not skip:
            self._old_logprobs(mbs, mode)
        t1 = time.perf_counter()
        if self.cfg.loss.uses_reference and self.cfg.loss.reference_due(self.policy_version):
            for mb in mbs:
                mb.ref_lp = self.compute_logprobs([mb], mode, reference=True)[0]
        # seconds per pass (where a step's time goes; r3flow local's bench reads them)
        metrics: dict[str, Any] = {"old_pass_seconds": t1 - t0, "old_pass_skipped": skip,
                                   "ref_pass_seconds": time.perf_counter() - t1}
        if not skip:
            metrics |= self._diffs(mbs, _old_lps(mbs), "")
        r = self.cfg.replay
        if r.compare_off and mode != ReplayMode.OFF and self.policy_version % r.compare_off_every == 0:
            # Same batch, same weights, natural routing: what replay bought on this step.
            t2 = time.perf_counter()
            metrics |= self._diffs(mbs, self.compute_logprobs(mbs, ReplayMode.OFF), "_off")
            metrics["compare_off_seconds"] = time.perf_counter() - t2
        if skip:
            return metrics
        metrics |= self._off_policy(mbs)
        agreement = self.backend.agreement
        agreement.check_used()
        if self._checks_agreement(mode):
            metrics |= self._agreement_metrics()
            agreement.check(self.cfg.replay.floor(self.backend.top_k, self.backend.num_experts),
                            self.cfg.replay.agreement_min_ids)
        return metrics

    def _old_logprobs(self, mbs: Sequence[MicroBatch], mode: ReplayMode) -> None:
        """The old-policy pass: `train_old_lp` on every micro-batch (agreement counted in r3)."""
        agreement = self.backend.agreement
        agreement.reset()
        agreement.enabled = self._checks_agreement(mode)
        try:
            old = self.compute_logprobs(mbs, mode)
        finally:
            agreement.enabled = False
        for mb, lp in zip(mbs, old, strict=True):
            mb.train_old_lp = lp

    def after_skipped_pass(self, mbs: Sequence[MicroBatch], mode: ReplayMode) -> dict:
        """What the skipped old-policy pass would have measured, from the update pass's
        logprobs (`train_old_lp`, set by `_ppo_loss`) and agreement counters (the backend
        checked the floor before its optimizer step): diffs, off-policy metrics (the TIS weights
        were applied in the loss), agreement."""
        metrics = self._diffs(mbs, _old_lps(mbs), "") | \
            self._off_policy(mbs, apply=False)
        return metrics | (self._agreement_metrics() if self._checks_agreement(mode) else {})

    def skips_old_pass(self, mode: ReplayMode) -> bool:
        """loss.skip_old_policy_pass for a step in `mode`: auto where it applies, on refused
        (one line) where it cannot."""
        setting = self.cfg.loss.skip_old_policy_pass
        if setting == "off":
            return False
        why = self.cfg.old_pass_refusal(mode.value)
        if why and setting == "on":
            raise ValueError(f"loss.skip_old_policy_pass: on does not apply to a {mode.value} "
                             f"step: {why}")
        return why is None

    def _diffs(self, mbs: Sequence[MicroBatch], lps: Sequence[torch.Tensor], suffix: str
               ) -> dict[str, Any]:
        """|rollout - trainer| logprob: mean and max, and the mean per staleness."""
        return diff_metrics(mbs, lps, suffix) | diff_by_staleness(mbs, lps, self.policy_version,
                                                                  suffix)

    def _off_policy(self, mbs: Sequence[MicroBatch], apply: bool = True) -> dict[str, Any]:
        """After the diffs: KL in the reward, staleness, IS weights and mismatch KL, and (with
        `apply`) the rollout correction set on `mbs` (MIS changes their loss masks)."""
        loss = self.cfg.loss
        if loss.kl_in == "reward" and loss.kl_coef > 0:
            kl_in_reward(mbs, loss)
        samples = [s for mb in mbs for s in mb.samples]
        return staleness_metrics(samples, self.policy_version) | apply_rollout_correction(
            mbs, loss.rollout_correction, apply=apply and loss.rollout_correction.enabled)

    def _agreement_metrics(self) -> dict[str, Any]:
        a = self.backend.agreement
        return {"routing_agreement": a.overall(),
                "routing_agreement_by_layer": a.per_layer()} | self._worst_cell()

    def _worst_cell(self) -> dict[str, Any]:
        """routing_agreement_min / _worst / _worst_layer (model numbering) of the counters of
        the last agreement-checked pass (empty when it filed no cell)."""
        a = self.backend.agreement
        worst = a.worst()
        if worst is None:
            return {}
        return {"routing_agreement_min": worst[1], "routing_agreement_worst": a.where(worst[0]),
                "routing_agreement_worst_layer": worst[0][3]}

    def _checks_agreement(self, mode: ReplayMode) -> bool:
        return mode == ReplayMode.R3 and self.cfg.replay.check_agreement

    def _in_flight(self) -> MicroBatch | None:
        return self.backend.current

    def _old_policy(self, samples: list[Sample], mode: ReplayMode, skip: bool
                    ) -> tuple[list[MicroBatch], dict, Fault | None]:
        """Micro-batches and the old-policy pass over them, decided on every rank together."""
        mbs = self.prepare(samples)  # a collective (micro-batch count): outside the guard
        metrics, fault = run_pass(lambda: self.old_policy_pass(mbs, mode, skip) if mbs else {},
                                  self._in_flight)
        return mbs, metrics or {}, fault

    # ------------------------------------------------------------------ steps
    def _ppo_loss(self, norm: UpdateNorm, acc: dict, blamed: dict[str, str], skip: bool,
                  mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        cfg, seq, n = self.cfg.loss, sequence_index(mb), len(mb.samples)
        lp, ent = policy_logprobs(logits, mb.labels_BS, cfg, mb.temperature_BS)
        if skip:  # this update's policy is the old policy: its logprobs, detached
            mb.train_old_lp = lp.detach()
            rc = cfg.rollout_correction
            if rc.is_level != "off":  # TIS against the rollout (MIS is refused: normaliser)
                mb.is_weight_BS = rollout_weights(mb.train_old_lp, mb.old_logprobs_BS,
                                                  mb.loss_mask_BS, seq, n, rc).is_weight_BS
        old = mb.old_logprobs_BS if self.cfg.data.old_logprobs == "rollout" else mb.train_old_lp
        assert old is not None, "old-policy pass must run before the update"
        sums = ppo_terms(lp, ent, mb.loss_mask_BS, mb.advantages_BS, old, mb.ref_lp, cfg,
                         seq_BS=seq, n_seqs=n, is_weight_BS=mb.is_weight_BS)
        for k in PPO_SUMS:
            acc[k] = acc.get(k, 0.0) + getattr(sums, k)
        assert sums.loss_BS is not None
        loss = aggregate(sums.loss_BS, mb.loss_mask_BS, seq, n, cfg.agg_mode, norm,
                         cfg.agg_norm_len)
        value = float(loss.detach())
        if not math.isfinite(value):  # whose? (the backend skips the update on every rank)
            loss_BS = sums.loss_BS.detach()
            blamed |= nonfinite_groups(mb, lambda b, sl: loss_BS[b, sl])
        acc["loss"] = acc.get("loss", 0.0) + value
        return loss

    def _updates(self, mbs: list[MicroBatch], mode: ReplayMode, skip: bool = False
                 ) -> tuple[dict, list[float], Fault | None]:
        """The step's updates until one faults: (PPO sums of the applied ones, their grad
        norms, the fault). A non-finite gradient no group's loss explains quarantines every
        group of that update."""
        acc: dict = {}
        norms: list[float] = []
        dp = self.backend.data_parallel_size
        for u in update_schedule(mbs, self.cfg.optim.ppo_epochs, self.cfg.optim.mini_batches):
            mine: dict = {}
            blamed: dict[str, str] = {}
            loss_fn = partial(self._ppo_loss, update_norm(u, dp), mine, blamed, skip)  # coll.
            norm, fault = run_pass(partial(self.backend.update, u, mode, loss_fn),
                                   self._in_flight, blamed)
            if fault is not None:
                if not fault.groups:  # every rank is here (the same union): blame alike
                    fault = gather(Fault({s.group_id: "non_finite" for mb in u
                                          for s in mb.samples}))
                return acc, norms, fault
            assert norm is not None
            norms.append(norm)
            for k, v in mine.items():
                acc[k] = acc.get(k, 0.0) + v
            acc["tokens"] = acc.get("tokens", 0.0) + _tokens(u)
        return acc, norms, None

    def train_step(self, samples: Sequence[Sample], replay: ReplayMode | str | None = None,
                   lr_scale: float = 1.0) -> dict:
        """One GRPO/PPO optimizer step on `samples`, its updates at lr x `lr_scale` (a step
        hook's, trainer.hooks); returns its metrics (`dropped`: group id -> reason of the groups
        quarantined in this step; `updates_skipped`, `updates_rerun`)."""
        t0 = time.perf_counter()
        mode = ReplayMode(replay or self.cfg.replay.mode)
        dropped = nonfinite_logprob_groups(samples)  # refused: no pass sees them
        samples = [s for s in samples if s.group_id not in dropped]
        skipped, rerun = 0, 0
        worst: list[dict[str, Any]] = [{}]  # the worst agreement cell of each faulting pass
        skip = self.skips_old_pass(mode)
        with self._scaled_lr(lr_scale):
            while True:
                mbs, metrics, fault = self._old_policy(samples, mode, skip)
                acc: dict = {}
                norms: list[float] = []
                if fault is None and mbs:  # as many micro-batches on every rank
                    t1 = time.perf_counter()
                    acc, norms, fault = self._updates(mbs, mode, skip)
                    metrics["update_seconds"] = time.perf_counter() - t1
                    if skip and fault is None:
                        metrics |= self.after_skipped_pass(mbs, mode)
                if fault is not None:
                    if not set(fault.groups) - set(dropped):  # the same union on every rank
                        raise RuntimeError(f"a step fault repeats with no new group to "
                                           f"quarantine: {fault.groups}")
                    skipped += 1
                    worst.append(self._worst_cell() if self._checks_agreement(mode) else {})
                    dropped |= fault.groups
                    samples = [s for s in samples if s.group_id not in dropped]
                    if not norms:
                        rerun += 1
                        continue  # nothing applied: the step again without them
                break
        worst_pass = min([*worst, metrics], key=_agreement_min)
        metrics |= worst_pass
        metrics |= {"dropped": dropped, "updates_skipped": skipped, "updates_rerun": rerun}
        if not norms:
            return metrics | {"trajectories": 0, "policy_version": self.policy_version,
                              "replay": mode.value, "skipped": True}
        self.policy_version += 1  # one version per step, however many updates it took
        return metrics | self._step_metrics(samples, mbs, acc, norms, mode, t0)

    @contextmanager
    def _scaled_lr(self, scale: float) -> Iterator[None]:
        """This step's updates at lr x `scale` (the lr schedule's and step hooks'), restored
        after it."""
        if scale == 1.0:
            yield
            return
        groups = self.backend.checkpoint_state()[1].param_groups
        saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] *= scale
        try:
            yield
        finally:
            for g, lr in zip(groups, saved, strict=True):
                g["lr"] = lr

    def _step_metrics(self, samples: Sequence[Sample], mbs: Sequence[MicroBatch], acc: dict,
                      norms: list[float], mode: ReplayMode, t0: float) -> dict:
        """Per-token means over every update (ppo_kl is 0 in the first, > 0 after it); a rank
        that trained no token (filler only) has None, never 0.0, for them."""
        dt, total = time.perf_counter() - t0, _tokens(mbs)
        seen = acc.get("tokens", 0.0)  # trained tokens summed over the applied updates
        keys = {"ppo_kl": "ppo_kl", "kl_ref": "kl_ref", "entropy": "entropy",
                "clip_ratio": "clipped", "clip_ratio_dual": "clipped_dual"}
        means = {k: acc.get(v, 0.0) / seen if seen else None for k, v in keys.items()}
        if self.cfg.loss.uses_reference and not any(mb.ref_lp is not None for mb in mbs):
            means["kl_ref"] = None  # no reference pass this step (loss.kl_metric_every)
        return means | {
            "loss": acc.get("loss", 0.0) / len(norms) if total else None,
            "grad_norm": float(np.mean(norms)), "updates": len(norms),
            "reward_mean": float(np.mean([s.reward for s in samples])) if samples else None,
            "trajectories": len(samples), "microbatches_padded": self.backend.padded,
            "step_seconds": dt, "tokens": total,
            "tokens_per_second": sum(s.tokens.size for s in samples) / dt,
            "policy_version": self.policy_version, "replay": mode.value}

    def sft_step(self, samples: Sequence[Sample]) -> dict:
        """Supervised step: cross-entropy on the response tokens (loss_mask), natural routing."""
        mbs = self.backend.microbatches(samples)
        total, acc = _tokens(mbs), {"loss": 0.0}

        def loss_fn(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            s, _ = sft_loss(logits, mb.labels_BS, mb.loss_mask_BS)
            acc["loss"] += float(s.detach()) / max(total, 1.0)
            return s / max(total, 1.0)

        grad_norm = self.backend.update(mbs, ReplayMode.OFF, loss_fn)
        self.policy_version += 1
        return {"loss": acc["loss"], "grad_norm": grad_norm, "tokens": total,
                "policy_version": self.policy_version}

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (a collective: every rank must call it)."""
        return self.backend.export_hf_state_dict()
