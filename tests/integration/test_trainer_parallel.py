"""Megatron parallel layouts with routing replay over gloo (2 CPU processes) against 1 rank.

For each layout megatron-core 0.19 runs on CPU with its local spec, one r3 batch with rollout
routing (random distinct ids per row: a row fed to the wrong token or layer changes logprobs):
  * per-token logprobs of the r3 pass equal the 1-rank fp32 reference within 1e-5;
  * the experts every router used are the rollout's ids at that token and HF layer (each rank
    checks its own layers and sequence slice against the samples' routing, by its own index
    arithmetic);
  * the grad norm of one r3 step equals the reference within 1e-5, and the logprobs after it too.
Each rank gets the loop's share (whole groups dealt over every rank); the ranks of one model
replica (TP x PP) train the union of their shares, data-parallel replicas their own (same token
count each, so the DP mean equals the 1-rank loss); a replica's routing agreement, merged over
its ranks, equals the 1-rank figure. The test runs this file as a script once per rank (`_worker`), the
reference in a 1-rank process of its own. tests/gpu/test_trainer_parallel_gpu.py reuses it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.ranks import run_script_ranks

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5

# name -> (world size, model overrides, optim overrides)
LAYOUTS: dict[str, tuple[int, dict, dict]] = {
    "tp2_sp": (2, {"tensor_parallel": 2, "sequence_parallel": True}, {}),
    "pp2": (2, {"pipeline_parallel": 2}, {}),
    "ep2": (2, {"expert_parallel": 2}, {}),
    "dp2_distopt": (2, {}, {"use_distributed_optimizer": True}),
    # the parameter all-gather left to the next forward's pre-hooks (lp_after reads through
    # them), several buckets; grouped experts read their weights from child modules
    "dp2_distopt_overlap": (2, {"experts": "grouped"}, {
        "use_distributed_optimizer": True, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "ddp_bucket_size": 20_000}),
    "ep2_recompute_full": (2, {"expert_parallel": 2, "recompute_granularity": "full",
                               "recompute_method": "uniform", "recompute_num_layers": 1}, {}),
    "ep2_recompute_moe": (2, {"expert_parallel": 2, "recompute_granularity": "selective",
                              "recompute_modules": ["moe"]}, {}),
}
# replay-aware dispatch (trainer.megatron.planned_dispatch): split sizes from the plan in every
# forward and every whole-layer recompute, none from megatron's per-layer sync (manual: the
# layouts above already fill this test's time; test_planned_dispatch runs in make test)
PLANNED = {"ep2_planned_recompute_full": (2, {
    "expert_parallel": 2, "planned_dispatch": True, "recompute_granularity": "full",
    "recompute_method": "uniform", "recompute_num_layers": 1}, {})}
PLANNED_4 = {"tp2_sp_ep2_planned_recompute_moe": (4, {
    "tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2,
    "planned_dispatch": True, "recompute_granularity": "selective", "recompute_modules": ["moe"]},
    {})}
# the named 30B spec's combination (k8s/qwen3-30b-a3b-grpo-r3.yaml: PP2, EP, distributed
# optimizer, MoE recompute) on the fast path's modules (grouped experts, fused attention, the
# plan, overlapped grad reduce, fused AdamW), TP left out (PLANNED_4 has it): four ranks,
# PP2 x DP2, EP2 across the DP ranks
FAST_PP2_4 = {"pp2_ep2_fast_planned_recompute_moe": (4, {
    "pipeline_parallel": 2, "expert_parallel": 2, "experts": "grouped", "attention": "sdpa",
    "planned_dispatch": True, "recompute_granularity": "selective", "recompute_modules": ["moe"]},
    {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "fused_adam": True})}
CP_SKIP = ("megatron-core 0.19's local attention (DotProductAttention) asserts "
           "context_parallel_size == 1; CP needs TransformerEngine's TEDotProductAttention, "
           "which is not installed")


def run_layouts(tmp_path: Path, model_dir, layouts: dict[str, tuple], dtype: str = "fp32",
                gpu: bool = False, timeout: float = 280) -> dict[str, list[dict]]:
    """Run `layouts` (all of one world size) one after the other in one set of rank processes
    (process groups rebuilt per layout; a layout's model overrides may set its own dtype); per
    layout, each rank's results."""
    (world,) = {w for w, _, _ in layouts.values()}
    out = tmp_path / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    spec = json.dumps({name: {"model": {"dtype": dtype} | m, "optim": o}
                       for name, (_, m, o) in layouts.items()})
    ranks = run_script_ranks(__file__, out, [str(model_dir), spec], world, gpu=gpu,
                             timeout=timeout)
    return {name: [r[name] for r in ranks] for name in layouts}


def compare(ref: dict, ranks: list[dict], tol: float) -> dict:
    """Max |layout - reference| of logprobs (before/after the step) and the grad norm."""
    got: dict[str, dict[str, list]] = {"lp": {}, "lp_after": {}}
    for r in ranks:
        for key in got:
            got[key] |= r[key]
    out = {"grad_norm_diff": max(abs(r["grad_norm"] - ref["grad_norm"]) for r in ranks)}
    for key, vals in got.items():
        assert set(vals) == set(ref[key]), f"{key}: samples {sorted(vals)} vs {sorted(ref[key])}"
        out[f"{key}_max_diff"] = max(float(np.abs(np.subtract(vals[i], ref[key][i])).max())
                                     for i in vals)
    out["replayed_rows"] = sum(r["replayed_rows"] for r in ranks)
    out["replay_mismatch"] = sum(r["replay_mismatch"] for r in ranks)
    out["ok"] = (out["replay_mismatch"] == 0 and out["replayed_rows"] > 0
                 and max(out["grad_norm_diff"], out["lp_max_diff"], out["lp_after_max_diff"])
                 <= tol)
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(num_layers=4,
                                                                        first_k_dense=1))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("ref"), model_dir, {"ref": (1, {}, {})})["ref"][0]


@pytest.fixture(scope="module")
def layouts(model_dir, tmp_path_factory):
    return run_layouts(tmp_path_factory.mktemp("layouts"), model_dir, LAYOUTS)


@pytest.mark.parametrize("name", [*LAYOUTS, pytest.param("cp2", marks=pytest.mark.skip(
    reason=CP_SKIP))])
def test_layout_matches_one_rank(name, reference, layouts):
    ranks = layouts[name]
    assert all("error" not in r for r in ranks), [r.get("error") for r in ranks]
    res = compare(reference, ranks, TOL)
    print(name, res)
    assert res["replay_mismatch"] == 0 and res["replayed_rows"] > 0
    assert all(r["export_exact"] for r in ranks)  # the weight push's source, gathered back
    assert res["lp_max_diff"] <= TOL
    assert res["grad_norm_diff"] <= TOL
    assert res["lp_after_max_diff"] <= TOL
    if "recompute" in name:  # every forward's ids replayed once by its backward recompute
        for r in ranks:
            assert r["recomputes"] == r["forwards"] and sum(r["forwards"]) > 0, r
            assert r["grad_norm_off"] > 0  # an off step under recompute runs too
    if ranks[0]["dp"] == 1:  # one replica: agreement merged over its TP/PP ranks = 1 rank's
        assert [r["agreement"] for r in ranks] == [pytest.approx(reference["agreement"])] * 2


@pytest.mark.manual
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layouts_", [PLANNED, PLANNED_4, FAST_PP2_4],
                         ids=["ep2", "tp2_sp_ep2", "pp2_ep2_fast"])
def test_planned_dispatch_layout_matches_one_rank(layouts_, reference, model_dir, tmp_path):
    (name,) = layouts_
    ranks = run_layouts(tmp_path, model_dir, layouts_, timeout=600)[name]
    res = compare(reference, ranks, TOL)
    print(name, res, [r["dispatch"] for r in ranks])
    assert res["ok"], res
    # every r3 forward and recompute took its split sizes from the plan
    assert all(r["dispatch"][0] > 0 and r["dispatch"][1] == 0 for r in ranks), ranks
    assert all(r["recomputes"] == r["forwards"] for r in ranks)


def test_reference_step_moves_the_logprobs(reference):
    """The after-step comparison means something: one step changes the logprobs."""
    assert max(float(np.abs(np.subtract(reference["lp"][k], reference["lp_after"][k])).max())
               for k in reference["lp"]) > 100 * TOL


def test_layout_errors_name_the_field():
    from trainer.config import TrainerConfig
    from trainer.megatron.hf_mapping import MoeArch
    from trainer.megatron.parallel import check_layout

    def bad(msg: str, world: int = 2, arch=None, **model):
        with pytest.raises(ValueError, match=msg):
            check_layout(TrainerConfig(model=model).model, world, arch, 8)

    bad("context_parallel: .*TransformerEngine", context_parallel=2)
    bad("sequence_parallel", tensor_parallel=2)
    bad("world size 2", tensor_parallel=4, sequence_parallel=True)
    bad("expert_parallel", world=2, expert_parallel=4)
    arch = MoeArch(num_layers=3, moe_layers=(1, 2), hidden_size=64, num_heads=4, num_kv_heads=1,
                   head_dim=16, num_experts=6, top_k=2, moe_ffn=32, dense_ffn=64, vocab_size=128,
                   rms_eps=1e-6, rope_theta=1e4, norm_topk_prob=True, max_positions=64)
    bad("pipeline_parallel 2: does not divide the 3 layers", arch=arch, pipeline_parallel=2)
    bad("tensor_parallel 2: does not divide the 1 KV heads", arch=arch, tensor_parallel=2,
        sequence_parallel=True)
    bad("expert_parallel 4: does not divide the 6 experts", world=4, arch=arch, expert_parallel=4)
    with pytest.raises(ValueError, match="run.world_size|tensor_parallel"):
        TrainerConfig(run={"launcher": "ray", "world_size": 3},
                      model={"tensor_parallel": 2, "sequence_parallel": True})


def test_local_routing_keeps_only_the_ranks_rows():
    """A rank replays its stage's layers at its positions, in the router's order (t = s*B + b)."""
    import torch

    from trainer.samples.alignment import local_routing, shard_context_parallel, to_router_rows

    ids = torch.arange(2 * 8 * 3 * 2).view(2, 8, 3, 2)  # B=2, S=8, L=3, K=2: every id distinct
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 6:] = False
    pos = torch.arange(8).chunk(2)[1]  # SP rank 1 of 2
    got, got_valid = local_routing(ids, valid, [1, 2], pos)
    assert got.shape == (2, 4, 2, 2) and torch.equal(got_valid, valid[:, 4:])
    rows = to_router_rows(got)
    assert torch.equal(rows[0][1], ids[1, 4, 1]) and torch.equal(rows[1][2 * 3], ids[0, 7, 2])
    cp = shard_context_parallel(torch.arange(8).unsqueeze(0), 1, 2)[0]  # chunks 1 and 2
    assert cp.tolist() == [2, 3, 4, 5]
    assert torch.equal(local_routing(ids, valid, [0], cp)[0][:, :, 0], ids[:, 2:6, 0])


# ---------------------------------------------------------------- worker (one per rank)
def batch(num_layers: int, top_k: int, num_experts: int) -> list:
    """8 samples, 4 groups of 2, all 12 tokens; random distinct rollout ids per row and layer."""
    from trainer.samples.batch import Sample

    rng = np.random.default_rng(7)
    out = []
    for i in range(8):
        tokens = rng.integers(4, 100, 12)
        ids = np.argsort(rng.random((11, num_layers, num_experts)), -1)[..., :top_k]
        out.append(Sample(tokens, 6, np.full(6, -3.0, np.float32), np.ones(6, bool),
                          float(rng.random()), f"g{i // 2}", routing_TLK=ids.astype(np.int64),
                          trajectory_id=f"t{i}"))
    return out


def _check_replayed(tr, mbs, cfg) -> tuple[int, int]:
    """Run the r3 no-grad pass over `mbs` with router hooks; compare every used expert set with
    the rollout's ids at the token's position (this rank's SP slice) and HF layer."""
    import torch
    from megatron.core import parallel_state as ps

    b = tr.backend
    calls: list = []
    hooks = [r.register_forward_hook(lambda mod, i, o, m=m: calls.append((m, o[1].bool())))
             for m, r in enumerate(b.policy.routers)]
    try:
        for mb in mbs:
            calls.clear()
            tr.compute_logprobs([mb], "r3")
            B, S = mb.tokens_BS.shape
            pos = torch.arange(S)
            if cfg.model.sequence_parallel:
                pos = pos.chunk(ps.get_tensor_model_parallel_world_size())[
                    ps.get_tensor_model_parallel_rank()]
            rows = mism = 0
            for m, used_TE in calls:
                col = b.moe_layers.index(b.policy.moe_layers[m])
                used = used_TE.view(len(pos), B, -1).cpu()
                for j, x in enumerate(mb.samples):
                    for k, s in enumerate(pos.tolist()):
                        if s < x.routing_TLK.shape[0]:
                            want = set(x.routing_TLK[s, col].tolist())
                            mism += want != set(used[k, j].nonzero().flatten().tolist())
                            rows += 1
            yield rows, mism
    finally:
        for h in hooks:
            h.remove()


def _export_exact(tr, model_dir: str) -> bool:
    """The HF export (TP, PP and EP shards gathered; a collective) equals the checkpoint."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(str(Path(model_dir) / "model.safetensors"))
    got = tr.export_hf_state_dict()
    return set(ref) == set(got) and all(torch.equal(ref[k], got[k].float().cpu()) for k in ref)


def _dispatch_counts(backend) -> tuple[int, int]:
    """(planned, fallback) MoE dispatches so far (model.planned_dispatch; (0, 0) without)."""
    from trainer.megatron.planned_dispatch import dispatch_counts, planned_layers

    return dispatch_counts(planned_layers(backend.policy.module))


def _layout(model_dir: str, spec: dict) -> dict:
    """One layout on this rank: r3 replay check, logprobs, one step, logprobs again."""
    import torch
    from megatron.core import parallel_state as ps

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    cfg = TrainerConfig(model_dir=model_dir, model=spec["model"],
                        optim={"lr": 1e-6, **spec["optim"]},
                        data={"micro_batch_size": 2}, replay={"agreement_floor": 0.0})
    tr = make_trainer(cfg)
    b = tr.backend
    export_exact = _export_exact(tr, model_dir)
    samples = batch(len(b.moe_layers), b.top_k, b.num_experts)
    # The loop's share: whole groups dealt over every rank; ranks of one model replica (TP x PP)
    # train the union of their shares (MegatronBackend.microbatches).
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = [i for i, s in enumerate(samples) if int(s.group_id[1:]) % world == rank]
    local = [samples[i] for i in mine]
    replayed = list(_check_replayed(tr, tr.prepare(local), cfg))
    lp = tr.sample_logprobs(local, "r3")
    metrics = tr.train_step(local, "r3")
    lp_after = tr.sample_logprobs(local, "r3")
    mon = b.agreement
    counts = {"forwards": list(getattr(mon, "forwards", [])),
              "recomputes": list(getattr(mon, "recomputes", [])),
              "dispatch": _dispatch_counts(b)}
    # natural routing under recompute queues no ids: its recompute must route naturally too
    off = tr.train_step(local, "off")["grad_norm"] if cfg.model.recomputes_router else None
    return {
        "lp": {str(i): v.tolist() for i, v in zip(mine, lp, strict=True)},
        "lp_after": {str(i): v.tolist() for i, v in zip(mine, lp_after, strict=True)},
        "grad_norm": metrics["grad_norm"], "replayed_rows": sum(r for r, _ in replayed),
        "agreement": metrics["routing_agreement"], "dp": ps.get_data_parallel_world_size(),
        "replay_mismatch": sum(m for _, m in replayed),
        **counts, "grad_norm_off": off, "export_exact": export_exact,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def _worker(model_dir: str, out_path: str, layouts: dict) -> None:
    import faulthandler

    import torch
    from megatron.core import parallel_state as ps

    out = {}
    for name, spec in layouts.items():
        faulthandler.dump_traceback_later(150, exit=True)  # a stranded collective fails
        t0 = time.perf_counter()
        out[name] = _layout(model_dir, spec) | {"seconds": time.perf_counter() - t0}
        torch.distributed.barrier()
        ps.destroy_model_parallel()
    Path(out_path).write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
