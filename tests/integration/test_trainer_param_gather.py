"""optim.overlap_param_gather against the step-end all-gather: two ranks over gloo, DP 2, the
distributed optimizer, grouped experts (their stacked weights sit in child modules the parent
reads: the case a forward pre-hook could miss), overlapped grad reduce with small buckets (several
bucket groups, so megatron's bucket-after-bucket gather chain runs), two updates per step (a
forward between optimizer steps). Three runs, the step-end gather and the overlap with each
optim.param_gather_dispatch (forward: megatron's chain; step: every gather started at the step's
end), take the same three GRPO steps (r2) on each rank's own samples; after each step the
parameters are read the three ways the trainer reads them:

  step 1  export_hf_state_dict right after the step (no forward in between: explicit finish);
  step 2  the no-grad logprob pass (the unwrapped module: megatron's pre-hooks gather);
  step 3  checkpoint_state's module weights, then the streamed weight push (iter_hf_weights).

Every metric of every step (loss, grad norm, ppo_kl, entropy, clip ratios: the old-policy pass
and the second update's forward read the gathered parameters), the logprobs, the export, the
checkpoint weights and the stream must be equal bit for bit. Controls: with the overlap
(dispatch forward) the raw parameters read right after a step differ from the gathered ones and
no gather has started; with dispatch step every group's has; without the overlap all are done.
The test runs this file as a script once per rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.ranks import run_script_ranks

pytestmark = pytest.mark.timeout(240)  # ~30 s here, most of it two processes' imports
ROOT = Path(__file__).resolve().parents[2]
BUCKET = 20_000  # parameters per bucket: the tiny model's ~0.25M make several bucket groups
# run -> optim overrides: the step-end gather, then the overlap with both dispatch points
RUNS = {"step_end": {}, "overlap": {"overlap_param_gather": True},
        "overlap_step": {"overlap_param_gather": True, "param_gather_dispatch": "step"}}


def run_pair(tmp_path: Path, dtype: str = "fp32", gpu: bool = False) -> list[dict]:
    """The runs in one pair of rank processes (gloo on the CPU, NCCL with `gpu`); per rank,
    what `_worker` found."""
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    return run_script_ranks(__file__, tmp_path, [str(model), dtype], gpu=gpu)


def check_pair(ranks: list[dict]) -> None:
    for rank, res in enumerate(ranks):
        print(rank, res)
        assert res["bucket_groups"] >= 3, res  # the gather chain has links to follow
        # right after a step: with the overlap the gather is not done (forward: not even
        # started; step: started at the step's end), without it it is
        assert res["stale"]["step_end"] == [False] * 3 and res["stale"]["overlap"] == [True] * 3
        assert res["started"] == {"step_end": [True] * 3, "overlap": [False] * 3,
                                  "overlap_step": [True] * 3}, res
        assert res["moved"] > 0  # the steps change the weights (lr 1e-3)
        assert res["differences"] == [], res


@pytest.mark.manual  # ~30 s on the 2-core box; make test runs test_trainer_parallel's layout
def test_overlap_param_gather_equals_the_step_end_gather(tmp_path):
    check_pair(run_pair(tmp_path))


def test_overlap_param_gather_needs_the_distributed_optimizer_and_bucketing():
    from trainer.config import OptimConfig

    with pytest.raises(ValueError, match="optim.overlap_param_gather: needs optim.use_distrib"):
        OptimConfig(overlap_param_gather=True, overlap_grad_reduce=True)
    with pytest.raises(ValueError, match="optim.overlap_param_gather: needs optim.overlap_grad"):
        OptimConfig(overlap_param_gather=True, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="optim.ddp_bucket_size: needs optim.overlap_grad"):
        OptimConfig(ddp_bucket_size=1000)
    OptimConfig(overlap_param_gather=True, use_distributed_optimizer=True,
                overlap_grad_reduce=True, ddp_bucket_size=1000)


# ---------------------------------------------------------------- worker (one per rank)
def _raw(module) -> list:
    """The parameters as they are (no gather finished)."""
    return [p.detach().clone() for p in module.parameters()]


def _run(model_dir: str, dtype: str, optim: dict) -> tuple[dict, dict]:
    """Three GRPO steps; (`stale`/`started` per step, what each step's reads gave)."""
    import torch
    from megatron.core import parallel_state as ps
    from trainer_fixtures import toy_samples

    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    cfg = TrainerConfig(model_dir=model_dir, model={"experts": "grouped", "dtype": dtype},
                        data={"micro_batch_size": 2},
                        optim={"lr": 1e-3, "use_distributed_optimizer": True, "mini_batches": 2,
                               "overlap_grad_reduce": True, "ddp_bucket_size": BUCKET}
                        | optim)
    tr = make_trainer(cfg)
    b, rank = tr.backend, torch.distributed.get_rank()
    module = b.policy.module
    samples = toy_samples(100 + rank)
    before = _raw(module)
    got: dict = {}
    groups = b.ddp.bucket_groups + b.ddp.expert_parallel_bucket_groups
    info: dict = {"stale": [], "started": [], "bucket_groups": len(groups)}
    for step in range(3):
        m = tr.train_step(samples, "r2")
        got |= {f"{step}.{k}": torch.tensor(float(m[k])) for k in (
            "loss", "grad_norm", "ppo_kl", "entropy", "clip_ratio", "clip_ratio_dual")}
        raw = _raw(module)
        info["started"].append(all(g.param_gather_dispatched for g in groups))
        if step == 0:
            got |= {f"0.export.{k}": v for k, v in tr.export_hf_state_dict().items()}
        elif step == 1:
            got |= {f"1.lp.{i}": torch.tensor(v) for i, v in
                    enumerate(tr.sample_logprobs(samples, "off"))}
        else:
            got |= {f"2.ckpt.{k}": v.clone() for k, v in
                    b.checkpoint_state()[0].weights().items()}
            got |= {f"2.push.{k}": v.clone() for k, v in b.iter_hf_weights(sender=0)}
        info["stale"].append(any(not torch.equal(x, p) for x, p in
                                 zip(raw, module.parameters(), strict=True)))
    info["moved"] = sum(not torch.equal(x, p) for x, p in
                        zip(before, module.parameters(), strict=True))
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    return info, got


def _worker(model_dir: str, out_path: str, dtype: str) -> None:
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(150, exit=True)  # a stranded collective fails, not hangs
    runs = {name: _run(model_dir, dtype, optim) for name, optim in RUNS.items()}
    info, ref = runs["step_end"]
    diffs, worst = [], 0.0
    for name, (_, got) in runs.items():
        common = sorted(set(ref) & set(got))
        diffs += [f"{name}: {k}" for k in sorted(set(ref) ^ set(got))]
        diffs += [f"{name}: {k}" for k in common if not torch.equal(ref[k], got[k])]
        worst = max([worst] + [float((ref[k].double() - got[k].double()).abs().max())
                               for k in common if ref[k].numel()])
    Path(out_path).write_text(json.dumps({
        "differences": diffs, "max_abs_diff": worst,
        "bucket_groups": info["bucket_groups"],
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "stale": {name: i["stale"] for name, (i, _) in runs.items()},
        "started": {name: i["started"] for name, (i, _) in runs.items()},
        "moved": min(i["moved"] for i, _ in runs.values())}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
