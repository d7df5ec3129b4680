"""The trainer's CPU shims (trainer.megatron.cpu_shims) leave everything else in the process as
it was: HF models loaded after them are the same models.

Found as an order dependence: test_trainer_guard's natural samples (a plain transformers forward)
routed differently once a Megatron trainer had been built earlier in the pytest process. The
shims wrap torch's tensor factories; torch's device context tells factories by identity from a
set it builds on first use, so once built from the wrappers it missed `torch.tensor`, and
transformers, which builds a model under that context before loading it, left the rotary
`inv_freq` buffer uninitialised. Each check runs in a fresh interpreter: the set is built once
per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
import torch
from trainer.megatron.cpu_shims import apply_cpu_shims
assert apply_cpu_shims()  # before anything else touched torch's device context
from transformers import AutoModelForCausalLM
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

with torch.device("meta"):
    in_context = torch.tensor([1.0]).device.type
model_dir = build_tiny_moe(sys.argv[1], TinyMoeConfig(num_layers=2))
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
cfg = model.config
theta = cfg.rope_parameters["rope_theta"]
d = cfg.head_dim
want = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
got = model.model.rotary_emb.inv_freq.double()
print(json.dumps({"in_context": in_context,
                  "cuda_factory": torch.zeros(2, device="cuda").device.type,
                  "inv_freq_err": float((got - want).abs().max())}))
"""


def test_hf_model_loaded_after_the_shims_has_its_rope_and_the_shims_still_work(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tiny")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["in_context"] == "meta"  # torch.tensor is a factory to the device context
    assert out["cuda_factory"] == "cpu"  # what the shim is for: megatron's device="cuda"
    assert out["inv_freq_err"] < 1e-6, out  # was ~1 (uninitialised memory)
