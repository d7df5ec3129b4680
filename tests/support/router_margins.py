"""Engine-vs-trainer routing of a locally built, warm-started MoE, with and without the margin
recipe (TinyMoeConfig.router_aux_loss_coef: the warm start trains with the load-balancing loss):
tests/integration/test_router_margins.py on the CPU, tests/bench/bench_router_margins.py on the
CPU or a GPU (issue 57 item 4).

A model is built and warm-started exactly as `r3flow local` does for a config (services.local:
seeded model and task, the family's builder, the warm-start config), sampled by vLLM in bf16
with routed experts (tests.support.vllm_sampling) and scored by the megatron trainer in bf16:
  * slot agreement: the share of the engine's expert ids the trainer's own router also picks,
    per (token, MoE layer, k) slot: in the r3 pass (the trainer's `routing_agreement`, what the
    loop logs: upstream layers replay the engine's ids) and with natural routing throughout;
  * router mismatch: the share of (token, MoE layer) top-k SETS that differ (a "router" in the
    R3 paper's words), per layer and overall;
  * token mismatch: the share of tokens whose set differs in >= 1 MoE layer, as measured and
    as it would be at the published model's depth (`at_depth`, below).
Legend: B batch rows, S sequence, L MoE layers, K top-k.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

# arXiv 2510.11370 (Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and
# Inference Routers"), section 3, Qwen3-30B-A3B (48 MoE layers, 128 experts top-8), SGLang
# rollouts vs Megatron: ~10% of routers (token x layer top-k sets) differ, 94% of tokens differ
# in >= 1 layer, ~6 differing routers per token; train-inference k3 KL 1.535e-3 (Qwen3-8B dense:
# 6.4e-4), 7.5e-4 with R3. Per-slot agreement is not published: `slots_from_routers` derives it.
PUBLISHED: dict[str, Any] = {
    "model": "Qwen3-30B-A3B", "moe_layers": 48, "top_k": 8, "router_mismatch": 0.10,
    "token_mismatch": 0.94, "routers_per_token": 6.0, "kl_k3": 1.535e-3}


# The GPU model (configs/local-gpu-h200.yaml) in miniature for a CPU: the same init std, warm
# start (12 steps at 1e-3), 64 experts top-8, a dense first layer and the recipe's coefficient;
# 256 wide, 5 MoE layers. The full-size model (1024 wide, 7 MoE layers) needs a GPU.
MINIATURE: dict[str, Any] = {
    "warm_start_steps": 12, "warm_start_lr": 1.0e-3,
    "model": {"hidden_size": 256, "num_layers": 6, "first_k_dense": 1, "num_experts": 64,
              "top_k": 8, "moe_intermediate_size": 64, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "init_std": 0.02, "router_aux_loss_coef": 0.01}}


def per_layer_rate(token_share: float, layers: int) -> float:
    """The per-layer router mismatch that gives `token_share` over `layers` independent layers."""
    return 1.0 - (1.0 - token_share) ** (1.0 / layers)


def at_depth(router_mismatch: float, layers: int) -> float:
    """Share of tokens with >= 1 differing router over `layers` layers at a per-layer rate."""
    return 1.0 - (1.0 - router_mismatch) ** layers


def published_band(moe_layers: int, ids_per_router: tuple[float, float] = (1.0, 1.5)
                   ) -> dict[str, float]:
    """The published figures moved to `moe_layers` MoE layers, as a band: the per-layer router
    mismatch between what 94% of tokens over 48 independent layers implies (5.7%) and the
    ~6-of-48 routers per token (12.5%); the token share at that depth from both ends; the slot
    agreement with `ids_per_router` of the k ids swapped per differing router (not published:
    >= 1; a swap at the top-k boundary swaps one, and our models show 1.00-1.01)."""
    lo = per_layer_rate(PUBLISHED["token_mismatch"], PUBLISHED["moe_layers"])
    hi = PUBLISHED["routers_per_token"] / PUBLISHED["moe_layers"]
    k = PUBLISHED["top_k"]
    return {"router_mismatch_lo": lo, "router_mismatch_hi": hi,
            "slot_agreement_lo": 1.0 - hi * ids_per_router[1] / k,
            "slot_agreement_hi": 1.0 - lo * ids_per_router[0] / k,
            "token_mismatch_lo": at_depth(lo, moe_layers),
            "token_mismatch_hi": at_depth(hi, moe_layers)}


def differing_ids_BSL(mb) -> np.ndarray:
    """How many of vLLM's K ids the trainer's natural top-k (R2-recorded) lacks, [B, S, L]
    (0 on rows without engine routing)."""
    import torch

    b, s = mb.tokens_BS.shape
    own_SBLK = torch.stack(mb.replay_rows, 1).reshape(s, b, len(mb.replay_rows), -1)
    own_BSLK = own_SBLK.transpose(0, 1).cpu()
    engine_BSLK = mb.routing_BSLK.long().cpu()
    missing_BSL = (~(engine_BSLK[..., :, None] == own_BSLK[..., None, :]).any(-1)).sum(-1)
    return (missing_BSL * mb.valid_rows_BS.cpu()[..., None]).numpy()


def mismatch_BSL(mb) -> np.ndarray:
    """Where the trainer's natural top-k SET (R2-recorded) differs from vLLM's, [B, S, L]."""
    return differing_ids_BSL(mb) > 0


def samples(rollouts: list, layer_map, prompt_len: int) -> list:
    """Trainer samples of vLLM rollouts (tokens, logprobs, routing_TLK), groups of 2."""
    from trainer.samples.batch import Sample

    return [Sample(t, prompt_len, lp, np.ones(lp.size, bool), float(i % 2), f"g{i // 2}",
                   routing_TLK=layer_map.select(r)) for i, (t, lp, r) in enumerate(rollouts)]


def routing_figures(model_dir: Path, rollouts: list, prompt_len: int) -> dict[str, Any]:
    """Slot agreement (r3 pass), router and token mismatch (natural routing recorded by an r2
    pass) of `rollouts` against the megatron trainer in bf16 on `model_dir`."""
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig
    from trainer.replay import ReplayMode

    tr = make_trainer(TrainerConfig(model_dir=str(model_dir), model={"dtype": "bf16"},
                                    data={"micro_batch_size": 8},
                                    replay={"agreement_floor": 0.5}))
    lmap = tr.layer_map(range(rollouts[0][2].shape[1]))  # vLLM reports every hidden layer
    r3 = tr.old_policy_pass(tr.prepare(samples(rollouts, lmap, prompt_len)), ReplayMode.R3)
    mbs = tr.prepare(samples(rollouts, lmap, prompt_len))
    tr.compute_logprobs(mbs, "r2")  # natural routing, recorded into mb.replay_rows
    ids = np.concatenate([d.reshape(-1, d.shape[-1])[mb.valid_rows_BS.cpu().numpy().reshape(-1)]
                          for mb in mbs for d in [differing_ids_BSL(mb)]])  # [rows, L]
    rows, k = ids > 0, tr.backend.top_k
    router = float(rows.mean())
    return {"slot_agreement": r3["routing_agreement"],
            "slot_agreement_by_layer": r3["routing_agreement_by_layer"],
            "slot_agreement_natural": 1.0 - float(ids.mean()) / k,
            "router_mismatch": router, "router_mismatch_by_layer": rows.mean(0).tolist(),
            "ids_per_differing_router": float(ids[rows].mean()) if rows.any() else 0.0,
            "token_mismatch": float(rows.any(-1).mean()),
            "routers_per_token": float(rows.sum(-1).mean()),
            "token_mismatch_at_48_layers": at_depth(router, PUBLISHED["moe_layers"]),
            "moe_layers": int(rows.shape[1]), "tokens": int(rows.shape[0]),
            "logprob_diff_mean_r3": r3["logprob_diff_mean"]}


def warm_model(root: Path, local_cfg, aux: float) -> Path:
    """The model `r3flow local` would warm-start for `local_cfg` (its seed, family, sizes,
    task and warm-start steps), with `router_aux_loss_coef` set to `aux`, under `root`."""
    from services.local import family
    from services.local.config import seeded, warm_start_config
    from services.local.tasks import write_datasets
    from services.local.warm_start import WarmStartConfig, run

    task, model = seeded(local_cfg)
    write_datasets(task, root / "data")
    init = family.build_model(root / "model-init", local_cfg.family,
                              model.model_copy(update={"router_aux_loss_coef": aux}))
    if local_cfg.warm_start_steps == 0:
        return init
    conf = warm_start_config(local_cfg, root, init, root / "model-warm")
    return run(WarmStartConfig.model_validate(conf))


@contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to `n` inside (None: unchanged). One on a busy 2-core box,
    as `r3flow local` runs its warm start (services.local.run.WARM_START_ENV): with a thread per
    core the tiny model's warm start took 181 s at load 9 against ~7 s with one."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_arm(root: Path, local_cfg, aux: float, eager: bool = True, util: float = 0.9,
                prompts: int | None = None, threads: int | None = None) -> dict[str, Any]:
    """One arm: build + warm start (`warm_model`), vLLM rollouts (bf16, routed experts; a child
    process; `prompts` random prompts, default NUM_PROMPTS), `routing_figures`, in-process parts
    on `threads` torch threads; with the seconds of each part (each printed as it ends: a bench
    cut short shows where it was)."""
    with torch_threads(threads):
        return _measure_arm(root, local_cfg, aux, eager, util, prompts)


def _measure_arm(root: Path, local_cfg, aux: float, eager: bool, util: float,
                 prompts: int | None) -> dict[str, Any]:
    from tests.support.vllm_sampling import (
        MAX_TOKENS,
        NUM_PROMPTS,
        PROMPT_LEN,
        load_rollouts,
        sample_in_child,
    )

    t0 = time.perf_counter()
    model = warm_model(root, local_cfg, aux)
    t1 = time.perf_counter()
    print(f"[aux {aux}] built and warm-started in {t1 - t0:.1f} s", flush=True)
    sample_in_child(model, root / "r.npz", seed=local_cfg.seed,
                    num_prompts=prompts or NUM_PROMPTS, prompt_len=PROMPT_LEN,
                    max_tokens=MAX_TOKENS, max_model_len=256, enforce_eager=eager,
                    gpu_memory_utilization=util)
    t2 = time.perf_counter()
    print(f"[aux {aux}] vLLM rollouts in {t2 - t1:.1f} s", flush=True)
    figures = routing_figures(model, load_rollouts(root / "r.npz"), PROMPT_LEN)
    return {**figures, "router_aux_loss_coef": aux, "engine": "eager" if eager else "graphs",
            "seconds": {"warm": t1 - t0, "sample": t2 - t1, "score": time.perf_counter() - t2}}


def write_figures(path: Path, figures: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1))
