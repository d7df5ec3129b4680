"""Step metrics: reduced over ranks, exported to Prometheus through typed handles.

`TrainerMetrics` resolves every catalogued trainer metric (services.common.metric_catalog) once,
by name, when it is built; the loop then uses attributes, so a misspelt metric is a type error
instead of a silent no-op. A handle is None where the registry has no such metric (tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

PREFIX = "r3flow_trainer_"
# step-metric key -> gauge (r3flow_trainer_<key>), set from each step's metrics when present
GAUGE_KEYS = ("ppo_kl", "kl_ref", "clip_ratio", "logprob_diff_mean", "logprob_diff_max",
              "logprob_diff_far_share",
              "grad_norm", "entropy", "reward_mean", "tokens_per_second", "policy_version",
              "clip_ratio_dual", "is_weight_mean", "is_weight_max", "is_truncated_share",
              "is_masked_share", "mismatch_kl", "dynamic_sampling_dropped_share")
# |rollout - trainer| logprob by staleness: step-metric key -> (staleness, routing) labels
DIFF_BY_STALENESS = {f"logprob_diff_mean{r}_{s}": (s, routing)
                     for r, routing in (("", "run"), ("_off", "off")) for s in ("fresh", "stale")}


# what names a minimum is taken from the rank that holds it: key -> the minimum's key
OF_THE_MIN = {"routing_agreement_worst": "routing_agreement_min",
              "routing_agreement_worst_layer": "routing_agreement_min"}
# counts every rank holds alike (the ranks decide faults together): kept as the one int
SAME_ON_EVERY_RANK = ("updates_skipped", "updates_rerun")


def reduce_metrics(per_rank: list[dict]) -> dict:
    """Mean over ranks (max for *_max, min for *_min); dict values (per-layer agreement)
    averaged per key, `*_hist` counts summed; what names a minimum (the worst agreement cell and
    its layer) comes from the rank with that minimum.
    A rank that trained only padding micro-batches has no value (None or no key) for what it
    did not measure (reward, agreement): such a metric is reduced over the ranks that have it."""
    out: dict = {}
    for k in dict.fromkeys(k for r in per_rank for k in r):
        vals = [r[k] for r in per_rank if r.get(k) is not None]
        v = vals[0] if vals else None
        if k in OF_THE_MIN:
            ranked = [r for r in per_rank if r.get(k) is not None
                      and r.get(OF_THE_MIN[k]) is not None]
            out[k] = min(ranked, key=lambda r: r[OF_THE_MIN[k]])[k] if ranked else v
        elif k in SAME_ON_EVERY_RANK:
            out[k] = int(max(vals)) if vals else None
        elif isinstance(v, dict):
            agg = np.sum if k.endswith("_hist") else np.mean
            out[k] = {kk: float(agg([x[kk] for x in vals if kk in x]))
                      for kk in dict.fromkeys(kk for x in vals for kk in x)}
        elif k == "trajectories":
            out[k] = int(sum(vals))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            reduce = np.max if "_max" in k else np.min if "_min" in k else np.mean
            out[k] = float(reduce(vals))
        else:
            out[k] = v
    return out


@dataclass
class TrainerMetrics:
    """The trainer's Prometheus handles (None: not registered)."""

    gauges: dict[str, Any]  # GAUGE_KEYS entry -> its gauge
    routing_agreement: Any = None
    step_seconds: Any = None
    steps: Any = None
    groups_quarantined: Any = None
    groups_stale: Any = None
    weight_push_seconds: Any = None
    weight_push_failures: Any = None
    staleness: Any = None  # histogram of samples' versions behind
    diff_by_staleness: Any = None
    updates_skipped: Any = None
    updates_rerun: Any = None
    last_step_time: Any = None  # unix time of the last completed step (the stall alert's)
    step_interval: Any = None
    last_step_at: float = 0.0

    @classmethod
    def of(cls, registered: dict[str, Any] | None) -> TrainerMetrics:
        """Handles from services.common.metrics.create_metrics(registry, "trainer")."""
        r = registered or {}
        return cls(
            gauges={k: r[PREFIX + k] for k in GAUGE_KEYS if PREFIX + k in r},
            routing_agreement=r.get(PREFIX + "routing_agreement_ratio"),
            step_seconds=r.get(PREFIX + "step_seconds"), steps=r.get(PREFIX + "steps_total"),
            groups_quarantined=r.get(PREFIX + "groups_quarantined_total"),
            groups_stale=r.get(PREFIX + "groups_stale_total"),
            weight_push_seconds=r.get(PREFIX + "weight_push_seconds"),
            weight_push_failures=r.get(PREFIX + "weight_push_failures_total"),
            staleness=r.get(PREFIX + "sample_staleness_versions"),
            diff_by_staleness=r.get(PREFIX + "logprob_diff_mean_by_staleness"),
            updates_skipped=r.get(PREFIX + "updates_skipped_total"),
            updates_rerun=r.get(PREFIX + "updates_rerun_total"),
            last_step_time=r.get(PREFIX + "last_step_timestamp_seconds"),
            step_interval=r.get(PREFIX + "step_interval_seconds"))

    def export_step(self, m: dict) -> None:
        """Set the gauges, agreement per layer (`layer`: the model's layer number), step time,
        step count and the updates a fault skipped / re-ran of one step."""
        for key, gauge in self.gauges.items():
            if m.get(key) is not None:
                gauge.set(m[key])
        self._export_off_policy(m)
        if self.routing_agreement is not None and m.get("routing_agreement") is not None:
            self.routing_agreement.labels(layer="all").set(m["routing_agreement"])
            for layer, v in m.get("routing_agreement_by_layer", {}).items():
                self.routing_agreement.labels(layer=str(layer)).set(v)
        for counter, key in ((self.updates_skipped, "updates_skipped"),
                             (self.updates_rerun, "updates_rerun")):
            if counter is not None and m.get(key):
                counter.inc(m[key])
        if self.step_seconds is not None:
            self.step_seconds.observe(m.get("step_seconds", 0.0))
        if self.steps is not None:
            self.steps.inc()
        self._export_step_time(time.time())

    def _export_step_time(self, now: float) -> None:
        """When this step completed and how long after the one before (R3flowTrainerStalled
        fires when no step completes for several times that)."""
        if self.last_step_at and self.step_interval is not None:
            self.step_interval.set(now - self.last_step_at)
        self.last_step_at = now
        if self.last_step_time is not None:
            self.last_step_time.set(now)

    def _export_off_policy(self, m: dict) -> None:
        """Samples' staleness into its histogram; |Delta logprob| per staleness class."""
        if self.staleness is not None:
            for behind, n in m.get("staleness_hist", {}).items():
                for _ in range(int(n)):
                    self.staleness.observe(float(behind))
        if self.diff_by_staleness is not None:
            for key, (stale, routing) in DIFF_BY_STALENESS.items():
                if m.get(key) is not None:
                    self.diff_by_staleness.labels(staleness=stale, routing=routing).set(m[key])

    def quarantined(self, reason: str) -> None:
        if self.groups_quarantined is not None:
            self.groups_quarantined.labels(reason=reason).inc()

    def stale(self, groups: int) -> None:
        if self.groups_stale is not None:
            self.groups_stale.inc(groups)

    def weight_push(self, seconds: float) -> None:
        if self.weight_push_seconds is not None:
            self.weight_push_seconds.observe(seconds)
