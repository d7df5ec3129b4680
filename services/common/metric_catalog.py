"""The one list of r3flow's Prometheus metrics: name, type, labels and meaning.

Processes create their metrics from here (`services.common.metrics.create_metrics`), and the
dashboards, alert rules and docs are generated from or checked against it, so a panel can never
point at a metric nobody exports.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    # Label values exported at 0 from the start (one label only), so a dashboard shows 0 and
    # rate() works before the first event, instead of "no data".
    initial: tuple[str, ...] = ()


_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

TRAINER = [
    MetricSpec("r3flow_trainer_ppo_kl", "gauge", "PPO approximate KL between old and current policy"),
    MetricSpec("r3flow_trainer_kl_ref", "gauge", "KL of the policy to the frozen reference model"),
    MetricSpec("r3flow_trainer_logprob_diff_mean", "gauge",
               "mean |rollout logprob - trainer logprob| over trained tokens"),
    MetricSpec("r3flow_trainer_logprob_diff_max", "gauge",
               "max |rollout logprob - trainer logprob| over trained tokens"),
    MetricSpec("r3flow_trainer_logprob_diff_far_share", "gauge",
               "share of trained tokens with |rollout logprob - trainer logprob| > 1 (the "
               "mismatch's tail, which the mean hides)"),
    MetricSpec("r3flow_trainer_routing_agreement_ratio", "gauge",
               "fraction of replayed expert ids the trainer's own router also picks "
               "(layer='all' or the model's layer number, dense layers counted: the number "
               "the trainer's messages and the engines use)", ("layer",)),
    MetricSpec("r3flow_trainer_clip_ratio", "gauge", "fraction of tokens whose PPO ratio was clipped"),
    MetricSpec("r3flow_trainer_grad_norm", "gauge", "global gradient norm before clipping"),
    MetricSpec("r3flow_trainer_entropy", "gauge", "mean token entropy of the policy"),
    MetricSpec("r3flow_trainer_reward_mean", "gauge", "mean reward of the trained batch"),
    MetricSpec("r3flow_trainer_reward_std", "gauge",
               "standard deviation of the rewards of the trained batch"),
    MetricSpec("r3flow_trainer_accuracy", "gauge",
               "share of the trained batch's trajectories whose reward is at least "
               "data.correct_reward"),
    MetricSpec("r3flow_trainer_response_length_mean", "gauge",
               "mean response length (tokens, every segment) of the trained batch"),
    MetricSpec("r3flow_trainer_response_length_max", "gauge",
               "longest response (tokens) of the trained batch"),
    MetricSpec("r3flow_trainer_truncated_share", "gauge",
               "share of the trained batch's trajectories that stopped at max_tokens"),
    MetricSpec("r3flow_trainer_learning_rate", "gauge",
               "learning rate of the last step (schedule x step hooks)"),
    MetricSpec("r3flow_trainer_mfu", "gauge",
               "model FLOPs utilisation of the last step (6 x active params x tokens per "
               "training pass, 2 x per no-grad pass, over the devices' peak; no attention term)"),
    MetricSpec("r3flow_trainer_time_seconds", "gauge",
               "where the last step's wall time went, by part (batch_wait, ranks_step, updates "
               "(inside ranks_step), weight_push, checkpoint)", ("part",)),
    MetricSpec("r3flow_trainer_step_seconds", "histogram", "wall time of one training step",
               buckets=_SECONDS),
    MetricSpec("r3flow_trainer_tokens_per_second", "gauge", "trained tokens per second, last step"),
    MetricSpec("r3flow_trainer_steps_total", "counter", "optimizer steps taken"),
    MetricSpec("r3flow_trainer_last_step_timestamp_seconds", "gauge",
               "unix time the last optimizer step completed (0 before the first)"),
    MetricSpec("r3flow_trainer_step_interval_seconds", "gauge",
               "wall time between the last two completed steps (pull, train, push, checkpoint)"),
    MetricSpec("r3flow_trainer_groups_quarantined_total", "counter",
               "GRPO groups set aside (acked to the store as dropped), by reason",
               ("reason",)),
    MetricSpec("r3flow_trainer_updates_skipped_total", "counter",
               "step attempts a data fault abandoned before their update was applied (routing "
               "agreement, replay desync, OOM, non-finite update): their groups quarantined"),
    MetricSpec("r3flow_trainer_updates_rerun_total", "counter",
               "of the skipped attempts, those redone without the quarantined groups (the step "
               "still trained); the rest ended a step after an update of it was applied"),
    MetricSpec("r3flow_trainer_groups_stale_total", "counter",
               "GRPO groups dropped at intake: their oldest segment lags the trainer by more "
               "than data.max_policy_lag versions (acked to the store as dropped `stale`)"),
    MetricSpec("r3flow_trainer_policy_version", "gauge", "policy version of the trainer's weights"),
    MetricSpec("r3flow_trainer_clip_ratio_dual", "gauge",
               "fraction of tokens held by dual-clip (negative advantage, ratio above "
               "loss.clip_ratio_c)"),
    MetricSpec("r3flow_trainer_is_weight_mean", "gauge",
               "mean importance weight pi_old / mu (trainer old policy over the rollout's "
               "sampled-token probability) over trained tokens"),
    MetricSpec("r3flow_trainer_is_weight_max", "gauge", "max importance weight pi_old / mu"),
    MetricSpec("r3flow_trainer_is_truncated_share", "gauge",
               "share of trained tokens whose importance weight exceeds the TIS threshold"),
    MetricSpec("r3flow_trainer_is_masked_share", "gauge",
               "share of trained tokens outside the MIS bounds (left out when MIS is on)"),
    MetricSpec("r3flow_trainer_mismatch_kl", "gauge",
               "rollout-vs-trainer KL(mu || pi_old), k3 estimate over trained tokens"),
    MetricSpec("r3flow_trainer_sample_staleness_versions", "histogram",
               "policy versions between the trainer's weights and a trained sample's oldest "
               "segment (0: sampled by the weights the trainer holds)",
               buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24)),
    MetricSpec("r3flow_trainer_logprob_diff_mean_by_staleness", "gauge",
               "mean |rollout - trainer logprob| of fresh (staleness 0) and stale samples, with "
               "the run's routing (routing='run') and natural routing (routing='off')",
               ("staleness", "routing")),
    MetricSpec("r3flow_trainer_dynamic_sampling_dropped_share", "gauge",
               "share of a step's pulled groups dropped by dynamic sampling (equal rewards)"),
    MetricSpec("r3flow_trainer_weight_push_seconds", "histogram",
               "wall time of one weight push to the rollout engines", buckets=_SECONDS),
    MetricSpec("r3flow_trainer_weight_push_failures_total", "counter",
               "weight pushes that failed (a member died or stalled); engines kept old weights"),
]

STORE = [
    MetricSpec("r3flow_store_appends_total", "counter", "accepted append messages",
               ("kind",)),
    MetricSpec("r3flow_store_routing_raw_bytes_total", "counter",
               "routing bytes received, as uint8 ids (tokens*layers*topk)"),
    MetricSpec("r3flow_store_routing_encoded_bytes_total", "counter",
               "routing bytes kept in Redis after the codec and prompt dedup"),
    MetricSpec("r3flow_store_backlog_tokens", "gauge",
               "tokens of appended, not yet delivered trajectories (the admission budget's)"),
    MetricSpec("r3flow_store_unacked_tokens", "gauge",
               "tokens of groups delivered to trainers, not yet acked (max_unacked_tokens's)"),
    MetricSpec("r3flow_store_groups_ready", "gauge", "complete GRPO groups waiting for a trainer"),
    MetricSpec("r3flow_store_dropped_total", "counter",
               "trajectories dropped, by reason (other_run: sampled by another training run's "
               "weights, docs/store.md run fencing)", ("reason",), initial=("stale", "other_run")),
    MetricSpec("r3flow_store_redeliveries_total", "counter",
               "groups redelivered after their lease expired"),
    MetricSpec("r3flow_store_dead_lettered_total", "counter",
               "groups redelivered more than max_redeliveries times, set aside (never trained)"),
    MetricSpec("r3flow_store_rejections_total", "counter", "rejected requests, by reason",
               ("reason",)),
    MetricSpec("r3flow_store_pull_seconds", "histogram", "latency of a Pull call", buckets=_SECONDS),
    MetricSpec("r3flow_store_groups_acked_total", "counter", "groups acked by trainers"),
    MetricSpec("r3flow_store_policy_version", "gauge", "latest published policy version"),
]

ROLLOUT = [
    MetricSpec("r3flow_rollout_generated_tokens_total", "counter", "tokens generated by the engine"),
    MetricSpec("r3flow_rollout_inflight_requests", "gauge", "requests in the engine now"),
    MetricSpec("r3flow_rollout_aborts_total", "counter", "requests aborted for a weight update"),
    MetricSpec("r3flow_rollout_resumes_total", "counter", "aborted requests resumed (partial rollouts)"),
    MetricSpec("r3flow_rollout_weight_sync_seconds", "histogram",
               "pause + receive + load + resume time of one weight update", buckets=_SECONDS),
    MetricSpec("r3flow_rollout_policy_version", "gauge", "policy version the engine serves"),
    MetricSpec("r3flow_rollout_trainer_gone", "gauge",
               "1 while a trainer that was present is gone (the job ended): no new group starts"),
    MetricSpec("r3flow_rollout_trajectories_total", "counter", "finished trajectories, by outcome",
               ("outcome",)),
    MetricSpec("r3flow_rollout_eval_accuracy", "gauge",
               "held-out greedy accuracy of the last eval of a set (`source`: the set's name): "
               "share of prompts whose greedy answer's reward is at least eval.correct_reward",
               ("source",)),
    MetricSpec("r3flow_rollout_eval_pass_at_k", "gauge",
               "held-out pass@k of the last eval of a set (unbiased estimate from eval.samples "
               "samples per prompt)", ("source", "k")),
    MetricSpec("r3flow_rollout_eval_policy_version", "gauge",
               "policy version the last eval of a set scored", ("source",)),
    MetricSpec("r3flow_rollout_routing_check_failures_total", "counter",
               "captured routing that failed a sanity check (row count, range, all-zero)"),
    MetricSpec("r3flow_rollout_reward_failures_total", "counter",
               "reward calls that scored the fallback, by reason (timeout, error, invalid)",
               ("reason",), initial=("timeout", "error", "invalid")),
]

ALL: dict[str, list[MetricSpec]] = {"trainer": TRAINER, "store": STORE, "rollout": ROLLOUT}
