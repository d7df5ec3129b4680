"""The hf backend on 1 vs N local ranks (torch.multiprocessing, no Ray): equal in fp32, and what
each rank holds.

Every world size takes the same r3 GRPO step on the same 8 samples (4 groups; rank r gets
groups r, r+N, ...) from the same checkpoint, with the model's own routing as the rollout
routing. Reported per world size: response logprobs of all 8 samples before and after the step
(every rank computes them; rank 0's are compared), the grad norm, the weights after the step
(rank 0's export), peak host RSS and peak GPU memory per rank after the load and at the end.
Differences are against world size 1. CPU (gloo) or, when CUDA is there, one GPU per rank (NCCL).

  python tests/bench/hf_ranks.py --worlds 1 2 [--width 4] [--sharding hybrid --shard-group 1]
  [--sequence-parallel 2]
      [--no-meta-init] [--out bench-results/hf_ranks.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _rss_mb() -> float:
    """Peak resident set of this process (VmHWM: ru_maxrss would include the parent's peak
    from before the spawned interpreter's exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _gpu_mb() -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


def _samples(model_dir: Path, n: int = 8, prompt_len: int = 6) -> list:
    """n samples (groups of 2) whose routing and logprobs are the model's own (fp32)."""
    from transformers import AutoModelForCausalLM

    from trainer.samples.alignment import LayerMap
    from trainer.samples.batch import Sample

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate"))
    lm, k = LayerMap.build(layers, layers), hf.config.num_experts_per_tok
    rng, out = np.random.default_rng(0), []
    for i in range(n):
        r = int(rng.integers(4, 10))
        toks = torch.from_numpy(rng.integers(4, 90, prompt_len + r)).unsqueeze(0)
        with torch.no_grad():
            o = hf(toks, output_router_logits=True, use_cache=False)
        ids = torch.stack([x.topk(k, -1).indices for x in o.router_logits], 1).numpy()
        lp = torch.log_softmax(o.logits[0], -1)[:-1].gather(-1, toks[0, 1:, None])[:, 0]
        out.append(Sample(toks[0].numpy(), prompt_len, lp[prompt_len - 1:].numpy(),
                          np.ones(r, bool), float(rng.random()), f"g{i // 2}",
                          routing_TLK=lm.select(ids[:-1])))
    return out


def _rank(rank: int, world: int, port: int, cfg_json: str, samples: list, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig

    tr = make_trainer(TrainerConfig.model_validate_json(cfg_json))
    res = {"rss_load_mb": _rss_mb(), "gpu_load_mb": _gpu_mb(), "sharded": tr.backend.sharded}
    res["lp_before"] = [x.tolist() for x in tr.sample_logprobs(samples, "r3")]
    # r3 replays HF's own routing: before the step the logprobs are HF's (fp32, forced)
    res["lp_vs_hf_max_diff"] = _diff(res["lp_before"], [s.rollout_logprobs for s in samples])
    share = [s for s in samples if int(s.group_id[1:]) % world == rank]
    m = tr.train_step(share, "r3")
    res |= {"grad_norm": m["grad_norm"], "agreement": m["routing_agreement"],
            "lp_after": [x.tolist() for x in tr.sample_logprobs(samples, "r3")]}
    weights = tr.export_hf_state_dict()
    res |= {"rss_peak_mb": _rss_mb(), "gpu_peak_mb": _gpu_mb()}
    if rank == 0:
        torch.save({k: v.cpu() for k, v in weights.items()}, f"{out}/weights_{world}.pt")
    Path(f"{out}/rank{rank}_of_{world}.json").write_text(json.dumps(res))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _diff(a: list, b: list) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True))


def compare(out: Path, worlds: list[int]) -> dict:
    """Per world size: its ranks' figures and its differences from world size 1."""
    base = json.loads((out / "rank0_of_1.json").read_text()) if 1 in worlds else None
    w1 = torch.load(out / "weights_1.pt") if base else None
    table = {}
    for w in worlds:
        ranks = [json.loads((out / f"rank{r}_of_{w}.json").read_text()) for r in range(w)]
        row = {"grad_norm": ranks[0]["grad_norm"], "agreement": min(r["agreement"] for r in ranks),
               "sharded": ranks[0]["sharded"],
               "lp_vs_hf_max_diff": max(r["lp_vs_hf_max_diff"] for r in ranks)}
        for key in ("rss_load_mb", "rss_peak_mb", "gpu_load_mb", "gpu_peak_mb"):
            row[key] = [round(r[key], 1) for r in ranks]
        if base is not None and w1 is not None:
            ww = torch.load(out / f"weights_{w}.pt")
            row |= {"lp_before_max_diff": _diff(ranks[0]["lp_before"], base["lp_before"]),
                    "lp_after_max_diff": _diff(ranks[0]["lp_after"], base["lp_after"]),
                    "grad_norm_rel_diff": abs(row["grad_norm"] / base["grad_norm"] - 1),
                    "weights_max_diff": max(float((ww[k] - w1[k]).abs().max()) for k in w1)}
        table[w] = row
    return table


def main() -> None:
    import torch.multiprocessing as mp

    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from trainer.config import TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--width", type=int, default=1, help="hidden 128 x width, 8 x experts")
    ap.add_argument("--sharding", default="full")
    ap.add_argument("--shard-group", type=int, default=0)
    ap.add_argument("--no-meta-init", action="store_true")
    ap.add_argument("--sequence-parallel", type=int, default=1,
                    help="hf.sequence_parallel of the worlds > 1 (must divide them)")
    ap.add_argument("--out", default="bench-results/hf_ranks.json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hf_ranks_"))
    model = build_tiny_moe(tmp / "model", TinyMoeConfig(
        num_layers=3, first_k_dense=1, hidden_size=128 * a.width, num_experts=8 * a.width,
        moe_intermediate_size=64 * a.width))
    samples = _samples(model)
    for w in a.worlds:
        hf = {"sharding": a.sharding, "shard_group_size": a.shard_group if w > 1 else 0,
              "meta_init": not a.no_meta_init, "fsdp": "auto",
              "sequence_parallel": a.sequence_parallel if w > 1 else 1}
        cfg = TrainerConfig.model_validate({
            "backend": "hf", "model_dir": str(model), "hf": hf, "optim": {"lr": 1e-4},
            "data": {"micro_batch_size": 2}, "replay": {"agreement_floor": 0.9},
            "run": {"launcher": "ray" if w > 1 else "local", "world_size": w}})  # as Ray would
        mp.spawn(_rank, args=(w, _port(), cfg.model_dump_json(), samples, str(tmp)), nprocs=w)
    table = compare(tmp, a.worlds)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(table, indent=1))
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
