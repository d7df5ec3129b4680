"""The old-policy pass both trainer backends share (megatron `Trainer`, HF `HFTrainer`).

It needs from its host: `cfg` (TrainerConfig), `agreement` (an AgreementMonitor), `reference`
(a frozen model or None) and `compute_logprobs(mbs, mode, reference=False)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from trainer.batch import MicroBatch
from trainer.loss import logprob_diff
from trainer.replay import ReplayMode


def diff_metrics(mbs: Sequence[MicroBatch], lps: Sequence[torch.Tensor], suffix: str) -> dict:
    """Token-weighted mean and max |rollout - trainer| logprob over the trained tokens."""
    diffs = [logprob_diff(mb.old_logprobs_BS, lp, mb.loss_mask_BS)
             for mb, lp in zip(mbs, lps, strict=True)]
    w = np.array([mb.num_tokens for mb in mbs], dtype=np.float64)
    return {f"logprob_diff_mean{suffix}": float(np.dot([d[0] for d in diffs], w) / max(w.sum(), 1)),
            f"logprob_diff_max{suffix}": max(d[1] for d in diffs)}


class OldPolicyPass:
    """Mixin: `old_policy_pass(mbs, mode)`."""

    cfg: Any
    agreement: Any
    reference: Any
    compute_logprobs: Callable[..., list[torch.Tensor]]  # the host's method

    def old_policy_pass(self, mbs: Sequence[MicroBatch], mode: ReplayMode) -> dict:
        """Old-policy logprobs (+ agreement in r3), reference logprobs; returns metrics."""
        check = mode == ReplayMode.R3 and self.cfg.replay.check_agreement
        self.agreement.reset()
        self.agreement.enabled = check
        try:
            old = self.compute_logprobs(mbs, mode)
        finally:
            self.agreement.enabled = False
        for mb, lp in zip(mbs, old, strict=True):
            mb.train_old_lp = lp
            if self.reference is not None:
                mb.ref_lp = self.compute_logprobs([mb], mode, reference=True)[0]
        metrics: dict[str, Any] = diff_metrics(mbs, old, "")
        if self.cfg.replay.compare_off and mode != ReplayMode.OFF:
            # Same batch, same weights, natural routing: what replay bought on this step.
            metrics |= diff_metrics(mbs, self.compute_logprobs(mbs, ReplayMode.OFF), "_off")
        self.agreement.check_used()
        if check:
            metrics["routing_agreement"] = self.agreement.overall()
            metrics["routing_agreement_by_layer"] = self.agreement.per_layer()
            worst = self.agreement.worst()
            if worst is not None:
                metrics["routing_agreement_min"] = worst[1]
                metrics["routing_agreement_worst"] = worst[0]
            self.agreement.check(self.cfg.replay.agreement_floor)
        return metrics
