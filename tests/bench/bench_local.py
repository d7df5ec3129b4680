"""`make bench-local`: the main job (`r3flow local`, what `make run` runs) for its first N GRPO
steps, this tree against a baseline revision on the same box in the same session (issue 46).

The baseline (default 569d739, the commit of issue 46's slow runs; its dependency locks are this
tree's) is a `git archive` of that revision under /tmp with its C cores built, run with this
venv (PYTHONPATH points at it). The two run one after the other, alternating, `--rounds` times,
at their own defaults except `--steps`: the same 32 groups x 8 samples a step, model and task.
Timing on the shared 2-core box drifts by 2-4x over a day, so the figure is the ratio of the
two in the same session, not either rate alone.

Per run, over the window from step 1's log record to step N's (the steady state; step 1 also
waits for vLLM's boot and the first batch):
  steps_per_s          steps 2..N over that window
  trainer_busy_share   the trainer's own step_seconds (its passes over the batch) / window
  trainer_cpu_cores,   CPU seconds / window of the trainer's process tree (driver, Ray, rank)
  rollout_cpu_cores    and of the rollout worker's (with vLLM's engine processes), from /proc
  wall_s               the whole command (warm start, boot, steps, report)
`--smoke`: this tree only, the tests' small MoE, 2 steps of 4 groups, no warm start, no
Prometheus (tests/integration/test_bench_smoke.py). Writes bench-results/local.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from services.common.procenv import pythonpath  # noqa: E402

BASELINE_REV = "569d739"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# which child of `r3flow local` a process descends from (its argv after `services.cli`)
ROLES = {"train": "trainer", "rollout": "rollout", "store": "store"}


def baseline_tree(rev: str) -> Path:
    """`git archive REV` under /tmp with its C cores built (kept for the next call)."""
    tree = Path(tempfile.gettempdir()) / f"r3flow-bench-{rev}"
    if not (tree / ".built").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "services.common._build"], cwd=tree, check=True,
                       env=os.environ | {"PYTHONPATH": pythonpath(tree)})
        (tree / ".built").write_text(rev)
    return tree


def head_tree() -> Path:
    """A copy of this working tree (with its built C cores) under /tmp: edits made while the
    bench runs do not reach its runs."""
    tree = Path(tempfile.mkdtemp(prefix="r3flow-bench-head-")) / "r3flow"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "bench-results", "__pycache__", "*.egg-info"))
    return tree


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds, argv) of every process readable now."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            argv = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        # after the name: state ppid ... utime(14th field) stime(15th)
        out[int(d)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK, argv)
    return out


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds of the live processes under `root`, summed by the child of `r3flow local`
    they descend from (trainer, rollout, store; the rest: other)."""
    table = _proc_table()
    out: dict[str, float] = {}
    for pid, (_, cpu, _) in table.items():
        role, p, seen = None, pid, 0
        while p in table and p != root and seen < 64:
            parent, _, argv = table[p]
            if parent == root:
                words = argv.split()
                after = words[words.index("services.cli") + 1] if "services.cli" in words else ""
                role = ROLES.get(after, "other")
                break
            p, seen = parent, seen + 1
        if p == root and role is None and pid != root:
            role = "other"
        if role is not None:
            out[role] = out.get(role, 0.0) + cpu
    return out


class CpuSampler(threading.Thread):
    """CPU seconds by role when each GRPO step is reported: the run's train log is polled every
    POLL_S and the processes are read as soon as a step's record appears, while they still
    live. (A 1 s sampler paired with the records' times afterwards had no sample inside a
    2-step smoke's window, or none after the last step before the run exited: the figures were
    None, issue 59.)"""

    def __init__(self, root: int, runs: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.runs, self.done = root, runs, threading.Event()
        self.at_step: dict[int, tuple[float, dict[str, float]]] = {}  # step -> (time, cpu)

    def run(self) -> None:
        seen = 0
        while not self.done.wait(POLL_S):
            steps = _logged_steps(self.runs)
            if len(steps) > seen:
                sample = (time.time(), cpu_by_role(self.root))
                for step in steps[seen:]:
                    self.at_step[step] = sample
                seen = len(steps)

    def between(self, first: int, last: int) -> dict[str, float]:
        """CPU cores used by role from step `first`'s record to step `last`'s."""
        if first not in self.at_step or last not in self.at_step:
            raise RuntimeError(f"no CPU sample at step {first} or {last} (sampled at "
                               f"{sorted(self.at_step)}): the run ended before it was read")
        (t0, a), (t1, b) = self.at_step[first], self.at_step[last]
        if t1 <= t0:
            raise RuntimeError(f"steps {first} and {last} were read in one poll ({POLL_S} s)")
        return {k: (b[k] - a.get(k, 0.0)) / (t1 - t0) for k in b}


POLL_S = 0.1  # how often CpuSampler looks for a new step record


def _grpo_rows(run_dir: Path) -> list[dict]:
    log = run_dir / "trainer" / "train_log.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] \
        if log.exists() else []
    return [r for r in rows if "step" in r and r.get("kind", "grpo") == "grpo"]


def _logged_steps(runs: Path) -> list[int]:
    """The GRPO steps the run under `runs` logged so far (a line being written is skipped)."""
    try:
        return [r["step"] for d in runs.glob("local-*") for r in _grpo_rows(d)]
    except json.JSONDecodeError:
        return []


def run_once(tree: Path, steps: int, config: dict | None, label: str, keep: bool) -> dict:
    """One `r3flow local --steps N` from `tree`; its figures."""
    runs = Path(tempfile.mkdtemp(prefix=f"bench-local-{label}-"))
    cmd = [sys.executable, "-m", "services.cli", "local", "--steps", str(steps),
           "--runs-dir", str(runs)]
    if config:
        (runs / "config.json").write_text(json.dumps(config))
        cmd += ["--config", str(runs / "config.json")]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env=os.environ | {"PYTHONPATH": pythonpath(tree)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = CpuSampler(proc.pid, runs)
    sampler.start()
    output, _ = proc.communicate()
    wall = time.monotonic() - t0
    sampler.done.set()
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: r3flow local exited {proc.returncode}:\n{output[-3000:]}")
    (run_dir,) = runs.glob("local-*")
    rows = _grpo_rows(run_dir)
    if not keep:
        shutil.rmtree(runs, ignore_errors=True)  # a checkpoint a step: ~15 MB each
    t_first, t_last = rows[0]["time"], rows[-1]["time"]
    window = t_last - t_first
    cores = sampler.between(rows[0]["step"], rows[-1]["step"])
    passes = {k: round(statistics.mean(r.get(k, 0.0) for r in rows[1:]), 3)
              for k in ("old_pass_seconds", "ref_pass_seconds", "compare_off_seconds",
                        "update_seconds", "batch_wait_seconds", "weight_push_seconds",
                        "checkpoint_seconds") if any(k in r for r in rows[1:])}
    return {"label": label, "tree": str(tree), "run_dir": str(run_dir), "steps": len(rows),
            "wall_s": round(wall, 1), "window_s": round(window, 1),
            "steps_per_s": (len(rows) - 1) / window if window > 0 else None,
            "s_per_step": window / (len(rows) - 1) if len(rows) > 1 else None,
            "trainer_busy_share": sum(r["step_seconds"] for r in rows[1:]) / window
            if window > 0 else None,
            "trainer_cpu_cores": cores.get("trainer"), "rollout_cpu_cores": cores.get("rollout"),
            "store_cpu_cores": cores.get("store"), "other_cpu_cores": cores.get("other"),
            "mean_pass_seconds": passes, "load_avg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12, help="GRPO steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="baseline/this-tree pairs, alternating")
    ap.add_argument("--baseline-rev", default=BASELINE_REV)
    ap.add_argument("--no-baseline", action="store_true", help="this tree only")
    ap.add_argument("--smoke", action="store_true", help="this tree, tiny model, 2 steps")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders (/tmp)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "local.json")
    args = ap.parse_args(argv)
    config = None
    if args.smoke:
        args.steps, args.rounds, args.no_baseline = 2, 1, True
        # no warm start: the smoke checks the GRPO window's figures, never the warm model
        config = {"model": {}, "warm_start_steps": 0, "prometheus": False,
                  "trainer": {"data": {"groups_per_step": 4}, "run": {"metrics_linger_s": 0}}}
    base = None if args.no_baseline else baseline_tree(args.baseline_rev)
    head = REPO if args.smoke else head_tree()
    runs: list[dict] = []
    for i in range(args.rounds):
        pair = [("head", head)] + ([] if base is None else [(args.baseline_rev, base)])
        if i % 2:  # alternate which goes first: the box's load drifts within a session
            pair.reverse()
        for label, tree in pair:
            r = run_once(tree, args.steps, config, label, args.keep)
            print(f"round {i + 1} {label:>8}: {r['s_per_step']:.2f} s/step "
                  f"({r['steps_per_s']:.3f} steps/s), trainer busy {r['trainer_busy_share']:.2f}, "
                  f"cores trainer {r['trainer_cpu_cores'] or 0:.2f} rollout "
                  f"{r['rollout_cpu_cores'] or 0:.2f}, wall {r['wall_s']:.0f} s, load "
                  f"{r['load_avg'][0]:.1f}", flush=True)
            runs.append(r)
    mine = [r for r in runs if r["label"] == "head"]
    baseline = [r for r in runs if r["label"] != "head"]
    med = lambda rs, k: statistics.median(r[k] for r in rs) if rs else None  # noqa: E731
    if head != REPO:
        shutil.rmtree(head.parent, ignore_errors=True)
    report = {"smoke": args.smoke, "steps": args.steps, "rounds": args.rounds,
              "baseline_rev": None if base is None else args.baseline_rev,
              "steps_per_s": med(mine, "steps_per_s"),
              "trainer_busy_share": med(mine, "trainer_busy_share"),
              "rollout_cpu_cores": med(mine, "rollout_cpu_cores"),
              "trainer_cpu_cores": med(mine, "trainer_cpu_cores"),
              "wall_s": med(mine, "wall_s"),
              "baseline_steps_per_s": med(baseline, "steps_per_s"),
              "baseline_wall_s": med(baseline, "wall_s"),
              "runs": runs}
    report["speedup_vs_baseline"] = (report["steps_per_s"] / report["baseline_steps_per_s"]
                                     if baseline else None)
    report["wall_ratio_vs_baseline"] = (report["baseline_wall_s"] / report["wall_s"]
                                        if baseline else None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    if baseline:
        print(f"steps/s: this tree {report['steps_per_s']:.3f}, {args.baseline_rev} "
              f"{report['baseline_steps_per_s']:.3f}: {report['speedup_vs_baseline']:.2f}x "
              f"(medians of {args.rounds}); wall of {args.steps} steps "
              f"{report['wall_s']:.0f} s vs {report['baseline_wall_s']:.0f} s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
