"""Supervised warm start of the tiny MoE through the run's trainer backend (natural routing).

`python -m services.local.warm_start --config warm.json` reads an SFT JSONL file of
{"prompt", "answer"} pairs, takes `steps` cross-entropy steps on prompt+answer+EOS (loss on the
answer and EOS only) with `trainer.grpo.GRPOStep.sft_step` (the run's backend: megatron, or hf
for a family megatron refuses), then writes an HF checkpoint (exported weights + the initial model's config and tokenizer) that the rollout
workers and the GRPO trainer both start from. Progress goes to stdout as JSON lines for `r3flow local`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from services.common.config import StrictConfig, load_config


class WarmStartConfig(StrictConfig):
    """Supervised warm start before GRPO."""

    model_dir: str = Field("", description="initial HF checkpoint (random init)")
    out_dir: str = Field("", description="where the warm-started HF checkpoint is written")
    sft_path: str = Field("", description="JSONL of {prompt, answer}")
    steps: int = Field(150, ge=0, description="SFT optimizer steps")
    batch_size: int = Field(64, ge=1, description="examples per step")
    micro_batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    seed: int = 0
    backend: Literal["megatron", "hf"] = Field("megatron", description="trainer backend "
                                               "(r3flow local: the family's, services.local.family)")
    hf: dict[str, Any] = Field(default_factory=dict, description="trainer hf backend knobs "
                               "(trainer.hf.config.HFBackendConfig)")


def tokenize_examples(model_dir: str, path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + EOS) per JSONL row, with the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((prompt, answer))
    return out


def to_sample(prompt: list[int], answer: list[int]):
    from trainer.samples.batch import Sample

    r = len(answer)
    return Sample(np.asarray(prompt + answer, np.int64), len(prompt), np.zeros(r, np.float32),
                  np.ones(r, bool))


def aux_loss_coef(model_dir: str) -> float:
    """The model's load-balancing coefficient (HF `router_aux_loss_coef`; 0 where unset)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():  # not a checkpoint: the trainer names the missing model itself
        return 0.0
    return float(json.loads(path.read_text()).get("router_aux_loss_coef") or 0.0)


def trainer_config(cfg: WarmStartConfig):
    from trainer.config import TrainerConfig

    # The warm start plays the model's pre-training: with the load-balancing loss its config
    # names (the margin recipe, TinyMoeConfig.router_aux_loss_coef), as megatron-bridge maps
    # router_aux_loss_coef to moe_aux_loss_coeff; GRPO's own config leaves it off.
    aux = aux_loss_coef(cfg.model_dir)
    if aux and cfg.backend != "megatron":
        raise ValueError(f"backend: router_aux_loss_coef {aux} (the model's config) needs the "
                         f"megatron backend for the warm start, not {cfg.backend}")
    return TrainerConfig.model_validate({
        "model_dir": cfg.model_dir, "backend": cfg.backend, "hf": cfg.hf,
        **({"model": {"aux_loss_coeff": aux}} if aux else {}),
        "optim": {"lr": cfg.lr, "clip_grad": 1.0},
        "replay": {"mode": "off", "check_agreement": False},
        "data": {"micro_batch_size": cfg.micro_batch_size},
    })


def save_hf(trainer, src_dir: str, out_dir: str) -> Path:
    """Exported HF weights + the source checkpoint's config/tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().float().contiguous() for k, v in trainer.export_hf_state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in Path(src_dir).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    return out


def run(cfg: WarmStartConfig) -> Path:
    from trainer.backend import make_trainer

    examples = tokenize_examples(cfg.model_dir, cfg.sft_path)
    trainer = make_trainer(trainer_config(cfg))
    rng = random.Random(cfg.seed)
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = [to_sample(*examples[rng.randrange(len(examples))]) for _ in range(cfg.batch_size)]
        m = trainer.sft_step(batch)
        print(json.dumps({"kind": "sft", "step": step, "steps": cfg.steps, "loss": m["loss"],
                          "seconds": time.perf_counter() - t0}), flush=True)
    return save_hf(trainer, cfg.model_dir, cfg.out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.local.warm_start", description=__doc__)
    p.add_argument("--config", required=True, help="WarmStartConfig file (.json/.toml/.yaml)")
    args = p.parse_args(argv)
    out = run(load_config(WarmStartConfig, args.config))
    print(json.dumps({"kind": "sft_done", "out_dir": str(out)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
