"""Grafana dashboards, Prometheus alert rules and docs/metrics.md, generated from the catalog.

Every panel and alert names its metrics through `_m`, which looks them up in
`services.common.metric_catalog`, so generation fails on a metric nobody exports. The outputs are
committed (helm/r3flow/dashboards/*.json, helm/r3flow/rules/r3flow-alerts.yaml, docs/metrics.md)
and tests/chart checks they equal what this module generates:

    python -m services.common.dashboards --out helm/r3flow/dashboards/

Several releases (and their named runs) may share one Prometheus, so every alert aggregates and
joins `by (namespace, release)` (`release` is the Helm release, set on every target by the
chart's ServiceMonitor; `job` is the Service name, which differs per component and so cannot join
trainer and rollout series), and every dashboard query is filtered by the dashboard's namespace
and release variables. The panels and alerts are defined here; their Grafana JSON is drawn by
services.common.grafana.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.grafana import SCOPE, Panel, Query, annotation, dashboard
from services.common.metric_catalog import ALL, MetricSpec

CATALOG: dict[str, MetricSpec] = {s.name: s for specs in ALL.values() for s in specs}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_METRIC_RE = re.compile(r"\br3flow_[a-z0-9_]+\b")
_BY_SCOPE = f"by ({', '.join(SCOPE)})"


def _m(name: str) -> str:
    """`name` if the catalog has it (histogram series suffixes allowed), else ValueError."""
    if catalog_name(name) is None:
        raise ValueError(f"metric {name!r} is not in services/common/metric_catalog.py")
    return name


def catalog_name(series: str) -> str | None:
    """The catalogued metric a series name belongs to (`x_bucket` -> `x` for histograms)."""
    if series in CATALOG:
        return series
    for suffix in _HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and CATALOG.get(base, None) and CATALOG[base].kind == "histogram":
            return base
    return None


def metrics_in_expr(expr: str) -> set[str]:
    """Every r3flow series name a PromQL expression mentions."""
    return set(_METRIC_RE.findall(expr))


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str


# ---- alert rules (also drawn as annotations on the training-health dashboard) -------------------
PPO_KL, KL_REF = _m("r3flow_trainer_ppo_kl"), _m("r3flow_trainer_kl_ref")
DIFF_STALE = _m("r3flow_trainer_logprob_diff_mean_by_staleness")
AGREEMENT = _m("r3flow_trainer_routing_agreement_ratio")
BACKLOG = _m("r3flow_store_backlog_tokens")
UNACKED = _m("r3flow_store_unacked_tokens")
ROLLOUT_VERSION, TRAINER_VERSION = _m("r3flow_rollout_policy_version"), _m(
    "r3flow_trainer_policy_version")

STEPS = _m("r3flow_trainer_steps_total")


def _since_first_step(gauge: str, window: str) -> str:
    """The samples of the trainer gauge `gauge` over `window` taken after the pod's first step:
    the gauges read 0 from start-up until then, and a start-up longer than the steps since would
    make 0 the median (then any ordinary value held a minute fires). The sign of ppo_kl (the k1
    estimate goes negative) is kept."""
    return f"({gauge} and {STEPS} > 0)[{window}:]"


# A spike is relative to the run's own recent median (ppo_kl's normal level depends on the model,
# the lr and the batch), with an absolute floor so a near-zero median cannot trigger on noise.
PPO_KL_SPIKE = (f"{PPO_KL} > 5 * quantile_over_time(0.5, {_since_first_step(PPO_KL, '30m')})"
                f" and {PPO_KL} > 0.0005")
KL_REF_SPIKE = (f"{KL_REF} > 3 * quantile_over_time(0.5, {_since_first_step(KL_REF, '1h')})"
                f" and {KL_REF} > 0.01")
# Chance level is topk/num_experts (6% for Qwen3-30B-A3B); a healthy R3 run stays near 0.9.
AGREEMENT_LOW = f"{AGREEMENT} < 0.5"
# Growing: the 15-minute linear trend adds more than a quarter of the current backlog.
BACKLOG_GROWING = (f"{BACKLOG} > 10000 and "
                   f"deriv({BACKLOG}[15m]) * 900 > 0.25 * avg_over_time({BACKLOG}[15m])")
# Joined on the deployment: a rollout is stale against its own release's trainer only.
STALE_POLICY = (f"{ROLLOUT_VERSION} < on({', '.join(SCOPE)}) group_left() "
                f"(max {_BY_SCOPE} ({TRAINER_VERSION}) - 2)")

# No step completed for 5x the longest recent step (a checkpoint step included), and at least
# 5 minutes: the pipeline stalled (the store's WARNING log names a refused append's limit).
LAST_STEP = _m("r3flow_trainer_last_step_timestamp_seconds")
STEP_INTERVAL = _m("r3flow_trainer_step_interval_seconds")
_IDLE = f"(time() - max {_BY_SCOPE} ({LAST_STEP}))"
TRAINER_STALLED = (f"{_IDLE} > 5 * max {_BY_SCOPE} (max_over_time({STEP_INTERVAL}[1h])) "
                   f"and {_IDLE} > 300 and max {_BY_SCOPE} ({LAST_STEP}) > 0")

# Any group the trainer set aside (bad routing or sampling, agreement below floor).
QUARANTINED = "increase(r3flow_trainer_groups_quarantined_total[10m]) > 0"

ALERTS = (
    Alert("R3flowPpoKlSpike", PPO_KL_SPIKE, "1m", "warning",
          "ppo_kl spiked to {{ $value | humanize }} (over 5x its 30-minute median)",
          "Policy moved far from the policy that sampled the batch; look for routing or "
          "logprob mismatch (R3 panels) and partial-rollout bookkeeping."),
    Alert("R3flowKlRefSpike", KL_REF_SPIKE, "5m", "warning",
          "KL to the reference model jumped to {{ $value | humanize }} (over 3x its 1h median)",
          "The policy is drifting fast from the reference; training may be collapsing."),
    Alert("R3flowRoutingAgreementLow", AGREEMENT_LOW, "2m", "critical",
          "routing agreement {{ $value | humanizePercentage }} on layer {{ $labels.layer }}",
          "Replayed expert ids disagree with the trainer's router at near-chance level: a wrong "
          "layer map, an off-by-one row or physical/logical expert ids."),
    Alert("R3flowTrainerGroupsQuarantined", QUARANTINED, "0m", "warning",
          "trainer quarantined GRPO groups ({{ $labels.reason }})",
          "Groups were acked as dropped instead of trained on; the trainer log names each "
          "group and what failed (see docs/replay_guarantees.md)."),
    Alert("R3flowTrainerStalled", TRAINER_STALLED, "1m", "critical",
          "no trainer step for {{ $value | humanizeDuration }} (over 5x the recent step time)",
          "The pipeline stopped: the store's log names a refused append's limit and numbers "
          "(budget, undelivered, delivered-unacked); check that rollout workers are registered "
          "and the trainer pulls (docs/store.md \"Admission and acks\")."),
    Alert("R3flowStoreBacklogGrowing", BACKLOG_GROWING, "10m", "warning",
          "store backlog keeps growing ({{ $value | humanize }} tokens)",
          "Rollouts produce faster than trainers consume, or trainers are not acking."),
    Alert("R3flowRolloutStalePolicy", STALE_POLICY, "10m", "warning",
          "rollout {{ $labels.pod }} serves policy {{ $value }}, over 2 versions behind",
          "Weight sync to this rollout pod failed or it missed the update group."),
)


def rules_document() -> dict:
    """The Prometheus rule file (also embedded in the chart's PrometheusRule)."""
    rules = [{"alert": a.name, "expr": a.expr, "for": a.for_,
              "labels": {"severity": a.severity},
              "annotations": {"summary": a.summary, "description": a.description}}
             for a in ALERTS]
    return {"groups": [{"name": "r3flow", "rules": rules}]}


# ---- panels -------------------------------------------------------------------------------------
def _q(expr: str, legend: str) -> Query:
    for series in metrics_in_expr(expr):
        _m(series)
    return Query(expr, legend)


def _gauge(title: str, name: str, unit: str = "short", desc: str = "") -> Panel:
    return Panel(title, (_q(name, "{{pod}}"),), unit, desc or CATALOG[name].help)


def _quantiles(name: str) -> tuple[Query, ...]:
    rate = f"sum by (le) (rate({name}_bucket[5m]))"
    return (_q(f"histogram_quantile(0.5, {rate})", "p50"),
            _q(f"histogram_quantile(0.99, {rate})", "p99"))


TRAINING_PANELS = (
    _gauge("ppo_kl", PPO_KL, desc="PPO KL (old vs current policy); red marks = spike alert"),
    _gauge("KL to reference", KL_REF, desc="KL to the reference model; red marks = spike alert"),
    Panel("rollout vs train logprob |diff|", (
        _q("r3flow_trainer_logprob_diff_mean", "mean"),
        _q("r3flow_trainer_logprob_diff_max", "max")), "short",
        "mean and max |rollout logprob - trainer logprob|; R3 should keep the mean low"),
    Panel("routing agreement (all layers)", (_q(f'{AGREEMENT}{{layer="all"}}', "{{pod}}"),),
          "percentunit", CATALOG[AGREEMENT].help),
    Panel("routing agreement per layer", (_q(f'{AGREEMENT}{{layer!="all"}}', "layer {{layer}}"),),
          "percentunit", "per MoE layer, labelled with the model's layer number (dense layers "
          "counted, as in the trainer's messages); one low layer points at a layer-map error"),
    Panel("groups quarantined (trainer)", (_q(
        # a zero series while nothing was quarantined: the panel reads 0, not "no data"
        "sum by (reason) (increase(r3flow_trainer_groups_quarantined_total[10m])) "
        'or label_replace(vector(0), "reason", "none", "", "")',
        "{{reason}}"),
        _q("sum(increase(r3flow_trainer_updates_skipped_total[10m]))", "updates skipped"),
        _q("sum(increase(r3flow_trainer_updates_rerun_total[10m]))", "updates re-run")),
        "short", "GRPO groups set aside instead of trained, by reason (routing_agreement, "
          "replay_desync, oom, non_finite, non_finite_logprobs, intake checks; none: 0), and "
          "the update attempts those faults skipped / re-ran without them; "
          "docs/replay_guarantees.md"),
    Panel("clip ratio", (_q("r3flow_trainer_clip_ratio", "ppo clip"),
                         _q("r3flow_trainer_clip_ratio_dual", "dual clip")), "percentunit",
          "share of tokens clipped by PPO's ratio clip and held by dual-clip"),
    _gauge("grad norm", _m("r3flow_trainer_grad_norm")),
    _gauge("entropy", _m("r3flow_trainer_entropy")),
    _gauge("reward (batch mean)", _m("r3flow_trainer_reward_mean")),
    Panel("held-out eval (rollout workers)", (
        _q("max by (source) (r3flow_rollout_eval_accuracy)", "{{source}} greedy accuracy"),
        _q("max by (source, k) (r3flow_rollout_eval_pass_at_k)", "{{source}} pass@{{k}}")),
        "percentunit", "the last score of each held-out set (rollout eval section, "
        "services/rollout/evaluation.py): greedy accuracy and pass@k from n samples"),
    Panel("batch accuracy and reward spread", (
        _q("r3flow_trainer_accuracy", "accuracy"), _q("r3flow_trainer_reward_std", "reward std")),
        "short", "share of the trained batch's answers scored correct (reward >= "
        "data.correct_reward) and the std of its rewards"),
    Panel("response length (tokens)", (_q("r3flow_trainer_response_length_mean", "mean"),
                                       _q("r3flow_trainer_response_length_max", "max"))),
    _gauge("responses truncated at max_tokens", _m("r3flow_trainer_truncated_share"),
           "percentunit"),
    _gauge("learning rate", _m("r3flow_trainer_learning_rate")),
    Panel("step time by part", (_q("max by (part) (r3flow_trainer_time_seconds)", "{{part}}"),),
          "s", CATALOG["r3flow_trainer_time_seconds"].help),
    Panel("step seconds", _quantiles(_m("r3flow_trainer_step_seconds")), "s"),
    Panel("|rollout - train logprob| by staleness", (_q(
        f'{DIFF_STALE}{{routing="run"}}', "{{staleness}}"), _q(
        f'{DIFF_STALE}{{routing="off"}}', "{{staleness}}, natural routing")), "short",
        "fresh: samples from the weights the trainer holds (engine/trainer mismatch alone, "
        "what R3 acts on); stale: older versions (policy drift added)"),
    Panel("importance weights pi_old / mu", (_q("r3flow_trainer_is_weight_mean", "mean"),
                                             _q("r3flow_trainer_is_weight_max", "max"))),
    Panel("IS weights truncated / masked", (
        _q("r3flow_trainer_is_truncated_share", "truncated (TIS)"),
        _q("r3flow_trainer_is_masked_share", "masked (MIS)")), "percentunit",
        "share of trained tokens past the TIS threshold / outside the MIS bounds"),
    _gauge("rollout vs trainer mismatch KL", _m("r3flow_trainer_mismatch_kl")),
    Panel("sample staleness (versions behind)", _quantiles(
        _m("r3flow_trainer_sample_staleness_versions")), "short",
        CATALOG["r3flow_trainer_sample_staleness_versions"].help),
    _gauge("groups dropped by dynamic sampling", _m(
        "r3flow_trainer_dynamic_sampling_dropped_share"), "percentunit"),
    _gauge("trained tokens/s", _m("r3flow_trainer_tokens_per_second")),
    Panel("policy version (trainer)", (_q(f"max({TRAINER_VERSION})", "trainer"),)),
    Panel("captured routing failing checks (rollout)", (_q(
        "sum by (pod) (rate(r3flow_rollout_routing_check_failures_total[5m])) * 60",
        "{{pod}} / min"),), "short",
        "row count, id range or all-zero checks failed on engine routing; should stay at 0"),
)

_RAW, _ENC = _m("r3flow_store_routing_raw_bytes_total"), _m(
    "r3flow_store_routing_encoded_bytes_total")
_GEN = _m("r3flow_rollout_generated_tokens_total")
PIPELINE_PANELS = (
    Panel("rollout tokens/s", (_q(f"sum(rate({_GEN}[1m]))", "all pods"),
                               _q(f"sum by (pod) (rate({_GEN}[1m]))", "{{pod}}"))),
    Panel("in-flight and aborted requests", (
        _q("sum(r3flow_rollout_inflight_requests)", "in flight"),
        _q("sum(rate(r3flow_rollout_aborts_total[5m])) * 60", "aborted / min"),
        _q("sum(rate(r3flow_rollout_resumes_total[5m])) * 60", "resumed / min"))),
    Panel("store backlog", (_q(f"sum({BACKLOG})", "undelivered tokens"),
                            _q(f"sum({UNACKED})", "delivered, not acked tokens")), "short",
          f"{CATALOG[BACKLOG].help}; {CATALOG[UNACKED].help}"),
    Panel("groups ready", (_q("sum(r3flow_store_groups_ready)", "groups"),)),
    Panel("staleness drops", (
        _q("sum by (reason) (rate(r3flow_store_dropped_total[5m])) * 60", "{{reason}} / min"),)),
    Panel("routing bytes per generated token: raw vs encoded", (
        _q(f"sum(rate({_RAW}[5m])) / sum(rate({_GEN}[5m]))", "raw (uint8)"),
        _q(f"sum(rate({_ENC}[5m])) / sum(rate({_GEN}[5m]))", "encoded")), "bytes",
        "routing bytes the store received / kept per token the rollouts generated"),
    Panel("dead-lettered groups", (
        _q("sum(increase(r3flow_store_dead_lettered_total[1h]))", "dead-lettered / h"),),
        "short", CATALOG["r3flow_store_dead_lettered_total"].help),
    Panel("stale groups dropped at trainer intake", (
        _q("sum(increase(r3flow_trainer_groups_stale_total[1h]))", "stale / h"),),
        "short", CATALOG["r3flow_trainer_groups_stale_total"].help),
    Panel("redeliveries and rejections", (
        _q("sum(rate(r3flow_store_redeliveries_total[5m])) * 60", "redelivered / min"),
        _q("sum by (reason) (rate(r3flow_store_rejections_total[5m])) * 60",
           "rejected {{reason}} / min"))),
    Panel("weight push seconds (trainer)", _quantiles(_m("r3flow_trainer_weight_push_seconds")),
          "s"),
    Panel("weight sync seconds (rollout)", _quantiles(_m("r3flow_rollout_weight_sync_seconds")),
          "s"),
    Panel("finished trajectories by outcome", (_q(
        "sum by (outcome) (rate(r3flow_rollout_trajectories_total[5m])) * 60",
        "{{outcome}} / min"),)),
    Panel("policy version per rollout pod", (
        _q(f"max by (pod) ({ROLLOUT_VERSION})", "{{pod}}"),
        _q(f"max({TRAINER_VERSION})", "trainer"),
        _q("max(r3flow_store_policy_version)", "store"))),
)


def dashboards() -> dict[str, dict]:
    """File name -> Grafana 11.6 dashboard JSON."""
    spikes = [annotation("ppo_kl spike", PPO_KL_SPIKE, "red"),
              annotation("KL spike", KL_REF_SPIKE, "orange")]
    return {
        "r3-training-health.json": dashboard("r3flow-training", "r3flow: R3 training health",
                                             TRAINING_PANELS, spikes, TRAINER_VERSION),
        "pipeline.json": dashboard("r3flow-pipeline", "r3flow: pipeline", PIPELINE_PANELS, [],
                                   _m("r3flow_store_policy_version")),
    }


def metrics_markdown() -> str:
    """docs/metrics.md: one table of every catalogued metric."""
    lines = ["# r3flow metrics", "",
             "Generated by `python -m services.common.dashboards` from "
             "`services/common/metric_catalog.py`; do not edit by hand. Every process serves "
             "these on `/metrics` (and `/health`) from a private registry.", "",
             "| name | type | labels | process | meaning |", "|---|---|---|---|---|"]
    for process, specs in ALL.items():
        for s in specs:
            labels = ", ".join(f"`{x}`" for x in s.labels) or "–"
            meaning = s.help.replace("|", "\\|")  # a bare | would split the table cell
            lines.append(f"| `{s.name}` | {s.kind} | {labels} | {process} | {meaning} |")
    return "\n".join(lines) + "\n"


def render_all() -> dict[str, str]:
    """Repo-relative path -> the text this module generates (dashboards, rules, docs)."""
    out = {f"helm/r3flow/dashboards/{name}": json.dumps(d, indent=2) + "\n"
           for name, d in dashboards().items()}
    out["helm/r3flow/rules/r3flow-alerts.yaml"] = (
        "# Generated by `python -m services.common.dashboards`; do not edit by hand.\n"
        + yaml.safe_dump(rules_document(), sort_keys=False, width=100))
    out["docs/metrics.md"] = metrics_markdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="helm/r3flow/dashboards/",
                        help="dashboard folder; rules and docs go to their places beside it")
    parser.add_argument("--root", default=".", help="repository root")
    args = parser.parse_args(argv)
    root = Path(args.root)
    for rel, text in render_all().items():
        path = root / rel
        if rel.startswith("helm/r3flow/dashboards/"):
            path = Path(args.out) / Path(rel).name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
