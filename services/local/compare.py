"""`r3flow local --compare off,tis,r3,r3+tis`: the same local run once per arm (a replay mode
and/or a rollout correction; same seed, data, model and machine, one after the other) and one
report that overlays the arms step by step.

Each arm is a complete `LocalRun` in `<compare dir>/<arm>/local-*`; the comparison writes
`compare.json` (per-arm summary lines) and `compare.png` (reward, ppo_kl, clip fraction,
rollout/train |logprob diff| overall and of fresh samples, importance weights, mismatch KL and
routing agreement per step, one line per arm).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from services.local.report import mean_of

# (panel title, JSONL key) of the overlay, one line per arm in each panel
OVERLAY = [
    ("reward (mean)", "reward_mean"),
    ("ppo_kl", "ppo_kl"),
    ("clip fraction", "clip_ratio"),
    ("rollout vs train logprob |diff|", "logprob_diff_mean"),
    ("|diff| of fresh samples (trainer's own version)", "logprob_diff_mean_fresh"),
    ("IS weight pi_old / mu (mean)", "is_weight_mean"),
    ("IS weights past the TIS threshold 2", "is_truncated_share"),
    ("rollout vs trainer mismatch KL", "mismatch_kl"),
    ("routing agreement", "routing_agreement"),
]
# The chart's R3flowPpoKlSpike rule, applied per step instead of per scrape: ppo_kl above
# SPIKE_FACTOR x the running median of the steps before it, and above SPIKE_FLOOR.
SPIKE_FACTOR, SPIKE_FLOOR = 5.0, 5e-4


def compare_dir(runs_dir: str) -> Path:
    path = Path(runs_dir) / f"compare-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    path.mkdir(parents=True)
    return path


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; nan for no values."""
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return float("nan")
    pos = q * (len(vals) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def count_spikes(values: list[float]) -> int:
    """Steps whose value is a spike against the running median of the steps before it."""
    spikes = 0
    for i, v in enumerate(values):
        before = [x for x in values[:i] if math.isfinite(x)]
        if before and math.isfinite(v) and v > SPIKE_FLOOR and \
                v > SPIKE_FACTOR * percentile(before, 0.5):
            spikes += 1
    return spikes


def arm_summary(arm: str, rows: list[dict], reference: list[dict] | None,
                run: dict | None = None) -> dict:
    """One arm's headline figures; `reference` is the replay-off arm's rows (if any), `run`
    the arm's `r3flow local` summary (wall time, trajectory accounting)."""
    diff = mean_of(rows, "logprob_diff_mean")
    kls = [r.get("ppo_kl", math.nan) for r in rows]
    out = {"arm": arm, "steps": len(rows), "logprob_diff_mean": diff,
           # the same batches with natural routing (r3/r2 arms: replay.compare_off)
           "logprob_diff_mean_same_batch_off": _finite(mean_of(rows, "logprob_diff_mean_off")),
           "reward_first5": mean_of(rows[:5], "reward_mean"),
           "reward_last5": mean_of(rows[-5:], "reward_mean"),
           "ppo_kl_mean": mean_of(rows, "ppo_kl"), "ppo_kl_p99": percentile(kls, 0.99),
           "ppo_kl_spikes": count_spikes(kls),
           "clip_fraction_mean": mean_of(rows, "clip_ratio"),
           "routing_agreement": mean_of(rows, "routing_agreement")} | off_policy_figures(rows)
    off = mean_of(reference, "logprob_diff_mean") if reference else math.nan
    out["logprob_diff_ratio_vs_off"] = diff / off if off > 0 else None
    # step 1: every sample from the weights the trainer holds (the mismatch without drift)
    first = rows[0].get("logprob_diff_mean") if rows else None
    first_off = reference[0].get("logprob_diff_mean") if reference else None
    out["logprob_diff_step1"] = first
    out["logprob_diff_step1_ratio_vs_off"] = (first / first_off if first is not None
                                              and first_off else None)
    return out | run_figures(run or {})


def off_policy_figures(rows: list[dict]) -> dict:
    """Means over the steps of the IS-weight statistics, the mismatch KL and |Δlogprob| of
    fresh (sampled by the trainer's own version) and stale samples."""
    keys = ("is_weight_mean", "is_truncated_share", "is_masked_share", "mismatch_kl",
            "logprob_diff_mean_fresh", "logprob_diff_mean_stale", "logprob_diff_mean_off_fresh")
    out: dict = {k: _finite(mean_of(rows, k)) for k in keys}
    out["is_weight_max"] = _finite(max((r.get("is_weight_max") or math.nan for r in rows),
                                       default=math.nan))
    return out


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run_figures(run: dict) -> dict:
    """Wall time and the share of produced trajectories dropped as stale, from a run summary."""
    t = run.get("trajectories") or {}
    produced = t.get("produced") or 0
    stale = (t.get("dropped") or {}).get("stale", 0)
    return {"wall_seconds": run.get("wall_seconds"),
            "stale_fraction": stale / produced if produced else None}


def summary_line(s: dict) -> str:
    ratio, stale, wall = (s["logprob_diff_ratio_vs_off"], s.get("stale_fraction"),
                          s.get("wall_seconds"))
    first, first_ratio = s.get("logprob_diff_step1"), s.get("logprob_diff_step1_ratio_vs_off")
    return (f"{s['arm']:>4}: |Δlogprob| {s['logprob_diff_mean']:.3e}"
            f"{'' if ratio is None else f' ({ratio:.2f} x off)'}"
            f"{'' if first is None else f', step 1 {first:.3e}'}"
            f"{'' if first_ratio is None else f' ({first_ratio:.2f} x off)'}, ppo_kl mean "
            f"{s['ppo_kl_mean']:.2e} p99 {s['ppo_kl_p99']:.2e}, ppo_kl spikes "
            f"{s['ppo_kl_spikes']}, clip fraction {s['clip_fraction_mean']:.3f}, agreement "
            f"{s['routing_agreement']:.3f}, reward {s['reward_first5']:.3f} -> "
            f"{s['reward_last5']:.3f}{'' if stale is None else f', stale {stale:.1%}'}"
            f"{'' if wall is None else f', {wall:.0f} s'}"
            f"{_opt(s, 'logprob_diff_mean_fresh', ', |Δlogprob| fresh {:.3e}')}"
            f"{_opt(s, 'is_weight_mean', ', IS weight mean {:.3f}')}"
            f"{_opt(s, 'is_weight_max', ' max {:.2f}')}"
            f"{_opt(s, 'is_truncated_share', ' truncated {:.2%}')}"
            f"{_opt(s, 'mismatch_kl', ', mismatch KL {:.2e}')}")


def _opt(s: dict, key: str, fmt: str) -> str:
    return "" if s.get(key) is None else fmt.format(s[key])


def write_comparison(out_dir: Path, arms: dict[str, list[dict]],
                     runs: dict[str, dict] | None = None) -> dict:
    """compare.json and compare.png for the arms' step rows (and their run summaries);
    returns the JSON's content."""
    reference, runs = arms.get("off"), runs or {}
    summaries = [arm_summary(arm, rows, reference, runs.get(arm)) for arm, rows in arms.items()]
    data = {"arms": summaries}
    (out_dir / "compare.json").write_text(json.dumps(data, indent=2))
    plot_comparison(arms, out_dir / "compare.png")
    return data


def plot_comparison(arms: dict[str, list[dict]], out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for ax, (title, key) in zip(axes.flat, OVERLAY, strict=False):
        for arm, rows in arms.items():
            ax.plot([r["step"] for r in rows], [r.get(key, math.nan) for r in rows],
                    marker=".", label=arm)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    _plot_same_batch_ratio(axes.flat[-1], arms)
    fig.suptitle("r3flow local — arms on the same seed, data and machine")
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def _plot_same_batch_ratio(ax, arms: dict[str, list[dict]]) -> None:
    """Per step, a replaying arm's |Δlogprob| over the same batch's without replay: below 1 is
    what replay removed; step 1 (the trainer's own weights) shows the mismatch alone."""
    for arm, rows in arms.items():
        pts = [(r["step"], r["logprob_diff_mean"] / r["logprob_diff_mean_off"]) for r in rows
               if r.get("logprob_diff_mean") is not None and r.get("logprob_diff_mean_off")]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=arm)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("|Δlogprob| / same batch without replay")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        ax.legend()
