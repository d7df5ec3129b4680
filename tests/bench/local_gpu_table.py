"""Per-step table of `r3flow local` runs (issue 41 item 4): the train-inference mismatch with
the run's routing and with natural routing on the same batch, trainer tokens/s, push seconds,
and the rollout worker's tokens/s, from each run folder's trainer/train_log.jsonl, summary.json
and rollout summaries.

    python tests/bench/local_gpu_table.py RUN_DIR [RUN_DIR ...] [--out table.json] [--compare DIR]

`--compare DIR` also writes compare.json / compare.png (services.local.compare, one line per
arm, arms named QUANT:REPLAY from each run's rollout config) and prints the issue-57 goal
lines: per quantization, r3's k3 mismatch KL and extreme-token share (|Δ| > 1) against the off
arm's, and within each r3 arm the same batches scored without replay (routing + numerics)
against with it (numerics alone: the part replay cannot remove).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from services.local.report import read_log

# (column, train-log key, format); `_off` keys are the replay-off pass of the same batch
COLUMNS = [
    ("step", "step", "{:d}"),
    ("|Δlp|", "logprob_diff_mean", "{:.4f}"),
    ("|Δlp| off", "logprob_diff_mean_off", "{:.4f}"),
    ("k3", "mismatch_kl", "{:.2e}"),
    ("k3 off", "mismatch_kl_off", "{:.2e}"),
    (">1", "logprob_diff_far_share", "{:.4f}"),
    (">1 off", "logprob_diff_far_share_off", "{:.4f}"),
    ("agree", "routing_agreement", "{:.3f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("trainer tok/s", "tokens_per_second", "{:,.0f}"),
    ("push s", "weight_push_seconds", "{:.2f}"),
    # where a step's time went (the trainer's step line names the same parts)
    ("wait s", "batch_wait_seconds", "{:.2f}"),
    ("old s", "old_pass_seconds", "{:.2f}"),
    ("no-replay s", "compare_off_seconds", "{:.2f}"),
    ("update s", "update_seconds", "{:.2f}"),
    ("ckpt s", "checkpoint_seconds", "{:.2f}"),
]


def cell(rec: dict, key: str, fmt: str) -> str:
    v = rec.get(key)
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)


def mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return statistics.fmean(vals) if vals else None


def run_figures(run_dir: Path) -> dict:
    """One run's rows and headline figures."""
    rows = read_log(run_dir / "trainer" / "train_log.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text()) \
        if (run_dir / "summary.json").is_file() else {}
    workers = [json.loads(p.read_text()) for p in sorted((run_dir / "rollout").glob("*.json"))]
    tokens = sum(w.get("generated_tokens", 0) for w in workers)
    seconds = sum(w.get("seconds", 0.0) for w in workers)
    keys = [k for _, k, _ in COLUMNS[1:]]
    return {"run_dir": str(run_dir), "replay": summary.get("replay"), "steps": len(rows),
            "means": {k: mean(rows, k) for k in keys},
            "means_after_step1": {k: mean(rows[1:], k) for k in keys},
            "rollout_generated_tokens": tokens, "rollout_seconds": round(seconds, 1),
            "rollout_tokens_per_s": tokens / seconds if seconds else None,
            "wall_seconds": summary.get("wall_seconds"), "failure": summary.get("failure"),
            "out_of_budget": summary.get("out_of_budget"),
            "grpo_seconds": rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else None,
            "rows": [{k: r.get(k) for k in ["step", *keys, "reward_mean", "time"]} for r in rows]}


def arm_label(run_dir: Path) -> str:
    """QUANT:REPLAY of a run (engine.quantization from its rollout config, the replay mode
    from its summary or, without one, its step log)."""
    quant = "none"
    for p in sorted((run_dir / "configs").glob("rollout-*.json"))[:1]:
        quant = json.loads(p.read_text()).get("engine", {}).get("quantization", "none")
    summary = run_dir / "summary.json"
    replay = json.loads(summary.read_text()).get("replay") if summary.is_file() else None
    if replay is None:  # a run cut before its summary: the step log names it
        rows = read_log(run_dir / "trainer" / "train_log.jsonl")
        replay = rows[0].get("replay", "?") if rows else "?"
    return f"{'bf16' if quant == 'none' else quant}:{replay}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goal_lines(labelled: dict[str, dict]) -> list[str]:
    """r3 vs off per quantization (issue 57 item 5), and each r3 arm's own split."""
    lines = []
    for label, fig in labelled.items():
        quant, replay = label.split(":")
        m = fig["means"]
        if replay != "off":
            lines.append(
                f"{label}: same batches without replay / with: k3 "
                f"{_f(ratio(m['logprob_diff_k3_off'], m['logprob_diff_k3']))}, >1 share "
                f"{_f(ratio(m['logprob_diff_far_share_off'], m['logprob_diff_far_share']))}; "
                f"numerics (with replay) k3 {_f(m['logprob_diff_k3'])}, routing part "
                f"{_f(_minus(m['logprob_diff_k3_off'], m['logprob_diff_k3']))}")
        off = labelled.get(f"{quant}:off")
        if replay == "r3" and off is not None:
            o = off["means"]
            k3 = ratio(m["logprob_diff_k3"], o["logprob_diff_k3"])
            far = ratio(m["logprob_diff_far_share"], o["logprob_diff_far_share"])
            lines.append(f"{quant}: r3 / off k3 mismatch KL {_f(k3)} (goal <= 0.5), >1 share "
                         f"{_f(far)} (goal <= 0.2), |Δlp| "
                         f"{_f(ratio(m['logprob_diff_mean'], o['logprob_diff_mean']))}")
    return lines


def _minus(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def markdown(fig: dict) -> str:
    head = "| " + " | ".join(c for c, _, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for r in fig["rows"]:
        lines.append("| " + " | ".join(cell(r, k, f) for _, k, f in COLUMNS) + " |")
    m = fig["means"]
    lines.append("| mean | " + " | ".join(cell(m, k, f) for _, k, f in COLUMNS[1:]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", type=Path, help="write compare.json/png here; goal lines")
    args = ap.parse_args()
    figs = [run_figures(d) for d in args.runs]
    for fig in figs:
        m = fig["means"]
        ratio = (m["logprob_diff_mean"] / m["logprob_diff_mean_off"]
                 if m["logprob_diff_mean"] is not None and m["logprob_diff_mean_off"] else None)
        print(f"\n## replay={fig['replay']} {fig['run_dir']}: {fig['steps']} steps, rollout "
              f"{fig['rollout_generated_tokens']} tokens in {fig['rollout_seconds']} s, "
              f"|Δlp| / |Δlp| off (same batches) = {ratio}")
        print(markdown(fig))
    if args.out:
        args.out.write_text(json.dumps(figs, indent=1))
    if args.compare:
        from services.local.compare import write_comparison

        labels: list[str] = []
        for d in args.runs:  # two arms of one kind are told apart by their folder
            label = arm_label(d)
            labels.append(label if label not in labels else f"{label}({d.parent.name})")
        labelled = dict(zip(labels, figs, strict=True))
        args.compare.mkdir(parents=True, exist_ok=True)
        runs = {lb: json.loads((d / "summary.json").read_text())
                for lb, d in zip(labels, args.runs, strict=True) if (d / "summary.json").is_file()}
        write_comparison(args.compare, {lb: read_log(d / "trainer" / "train_log.jsonl")
                                        for lb, d in zip(labels, args.runs, strict=True)}, runs)
        print("\n" + "\n".join(goal_lines(labelled)))


if __name__ == "__main__":
    main()
