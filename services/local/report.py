"""Run report for `r3flow local`: per-step table lines and the PNG of the run's curves.

Reads the trainer's JSONL run log (one object per step); the PNG shows the same quantities as
the Grafana "R3 training health" dashboard: reward, ppo_kl, kl_ref, rollout/train logprob |diff|
(with the replay-off comparison of the same batch, and split by staleness), importance weights,
routing agreement, tokens/s and staleness.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# (column title, JSONL key, format)
TABLE_COLUMNS = [
    ("step", "step", "{:>4d}"),
    ("reward", "reward_mean", "{:>7.3f}"),
    ("acc", "accuracy", "{:>5.2f}"),
    ("ppo_kl", "ppo_kl", "{:>9.2e}"),
    ("kl_ref", "kl_ref", "{:>9.2e}"),
    ("|Δlp| r3", "logprob_diff_mean", "{:>9.2e}"),
    ("|Δlp| off", "logprob_diff_mean_off", "{:>9.2e}"),
    ("fresh r3", "logprob_diff_mean_fresh", "{:>9.2e}"),
    ("fresh off", "logprob_diff_mean_off_fresh", "{:>9.2e}"),
    ("IS w", "is_weight_mean", "{:>6.3f}"),
    ("agree", "routing_agreement", "{:>6.3f}"),
    ("tok/s", "tokens_per_second", "{:>7.0f}"),
]


def read_log(path: Path) -> list[dict]:
    """Step records from a JSONL run log (non-step records are skipped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "step" in rec and rec.get("kind", "grpo") == "grpo":
                rows.append(rec)
    return rows


def table_header() -> str:
    widths = [len(fmt.format(0 if "d" in fmt else 0.0)) for _, _, fmt in TABLE_COLUMNS]
    return "  ".join(t.rjust(w) for (t, _, _), w in zip(TABLE_COLUMNS, widths, strict=True))


def table_row(rec: dict) -> str:
    cells = []
    for _, key, fmt in TABLE_COLUMNS:
        value = rec.get(key)
        width = len(fmt.format(0 if "d" in fmt else 0.0))
        cells.append("-".rjust(width) if value is None else fmt.format(value))
    return "  ".join(cells)


def mean_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else float("nan")


def paired(rows: list[dict], *keys: str) -> list[dict]:
    """The rows with a finite value for every one of `keys`."""
    return [r for r in rows if all(r.get(k) is not None and math.isfinite(r[k]) for k in keys)]


def plot_report(rows: list[dict], out_png: Path, title: str) -> Path:
    """Six panels of the run's curves, written to `out_png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    panels = [
        ("reward (mean)", [("reward_mean", "reward")]),
        ("ppo_kl / kl_ref", [("ppo_kl", "ppo_kl"), ("kl_ref", "kl_ref")]),
        ("rollout vs train logprob |diff|", [("logprob_diff_mean", "r3 (replayed)"),
                                             ("logprob_diff_mean_off", "off (same batch)")]),
        ("|diff| by staleness (fresh: the trainer's own version)", [
            ("logprob_diff_mean_fresh", "fresh, run's routing"),
            ("logprob_diff_mean_off_fresh", "fresh, natural routing"),
            ("logprob_diff_mean_stale", "stale, run's routing"),
            ("logprob_diff_mean_off_stale", "stale, natural routing")]),
        ("importance weights pi_old / mu", [("is_weight_mean", "mean"), ("is_weight_max", "max")]),
        ("routing agreement", [("routing_agreement", "natural router vs replayed")]),
        ("tokens / s", [("tokens_per_second", "trained tokens/s")]),
        ("grad norm", [("grad_norm", "grad norm")]),
        ("staleness (versions behind)", [("staleness_mean", "mean"), ("staleness_max", "max")]),
    ]
    fig, axes = plt.subplots(3, 3, figsize=(15, 12))
    for ax, (name, series) in zip(axes.flat, panels, strict=True):
        for key, label in series:
            ys = [r.get(key, float("nan")) for r in rows]
            ax.plot(steps, ys, marker=".", label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


def summarize(rows: list[dict]) -> dict[str, float | None]:
    """Headline figures: reward rise (last 5 vs first 5 steps) and the r3-vs-off |diff| ratio."""
    first, last = rows[:5], rows[-5:]
    out: dict[str, float | None] = {"reward_first5": mean_of(first, "reward_mean"),
                                    "reward_last5": mean_of(last, "reward_mean")}
    out["reward_gain"] = mean_of(last, "reward_mean") - mean_of(first, "reward_mean")
    out["logprob_diff_mean"] = mean_of(rows, "logprob_diff_mean")
    # The no-replay comparison runs on step 1 and every grpo.measure_every-th step: the ratio
    # pairs the steps that measured both (same batches), never all steps against a sample.
    compared = paired(rows, "logprob_diff_mean", "logprob_diff_mean_off")
    on, off = mean_of(compared, "logprob_diff_mean"), mean_of(compared, "logprob_diff_mean_off")
    out["compared_steps"] = len(compared)
    out["logprob_diff_mean_compared"] = on if compared else None
    out["logprob_diff_mean_off"] = off
    out["logprob_diff_ratio_vs_off"] = on / off if off > 0 else None
    out["kl_ref_steps"] = sum(1 for r in rows if r.get("kl_ref") is not None)
    out["routing_agreement"] = mean_of(rows, "routing_agreement")
    return out | step1_diffs(rows) | by_staleness(rows)


def by_staleness(rows: list[dict]) -> dict[str, float | None]:
    """|Δlogprob| over the whole run, split by staleness: fresh samples (sampled by the version
    the trainer holds: the engine/trainer mismatch alone, what replay acts on) and stale ones
    (policy drift added), each with the run's routing and natural routing on the same batches."""
    out: dict[str, float | None] = {}
    for cls in ("fresh", "stale"):
        keys = [f"logprob_diff_mean{s}_{cls}" for s in ("", "_off")]
        on, off = (mean_of(paired(rows, *keys), k) for k in keys)
        out[f"logprob_diff_{cls}"] = on if math.isfinite(on) else None
        out[f"logprob_diff_{cls}_off"] = off if math.isfinite(off) else None
        out[f"logprob_diff_{cls}_ratio"] = on / off if off > 0 and math.isfinite(on) else None
    for key in ("is_weight_mean", "mismatch_kl", "kl_ref"):
        v = mean_of(rows, key)
        out[key] = v if math.isfinite(v) else None
    return out


def step1_diffs(rows: list[dict]) -> dict[str, float | None]:
    """|Δlogprob| of step 1, with and without replay (same batch): the only step whose samples
    were all generated by the weights the trainer holds (the warm start), so the engine/trainer
    mismatch alone; every later batch is up to max_policy_lag versions old and its |Δlogprob|
    adds that policy drift, which at lr 3e-4 is 10-20x the mismatch."""
    first = rows[0] if rows else {}
    on, off = first.get("logprob_diff_mean"), first.get("logprob_diff_mean_off")
    return {"logprob_diff_step1": on, "logprob_diff_step1_off": off,
            "logprob_diff_step1_ratio": on / off if on is not None and off else None}


def eval_rows(path: Path) -> list[dict]:
    """The held-out eval rows worker 0 wrote (services.rollout.evaluation), in order."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_start_end(rows: list[dict]) -> dict[str, dict]:
    """Per eval set: its first and last score (policy version, greedy accuracy, pass@k)."""
    out: dict[str, dict] = {}
    for r in rows:
        figures = {k: r.get(k) for k in ("policy_version", "accuracy", "pass_at_k")}
        out.setdefault(r["source"], {"start": figures, "scores": 0})
        out[r["source"]] |= {"end": figures, "scores": out[r["source"]]["scores"] + 1}
    return out


def tracking(run_dir: Path) -> dict:
    """Where the run's tracking went: TensorBoard event files, sample rows, held-out evals."""
    tb = run_dir / "trainer" / "tensorboard"
    return {"tensorboard_dir": str(tb),
            "tensorboard_files": len(list(tb.glob("events.out.tfevents.*"))),
            "samples_file": str(run_dir / "trainer" / "samples.jsonl"),
            "eval_log": str(run_dir / "eval_log.jsonl"),
            "eval": eval_start_end(eval_rows(run_dir / "eval_log.jsonl"))}
