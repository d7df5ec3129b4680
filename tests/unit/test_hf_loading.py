"""hf.meta_init loading (trainer/hf/loading.py): every tensor read from the checkpoint equals
what from_pretrained loads, whole or as a rank's rows; a converted tensor's layout (fused
experts) is walked once per name-after-the-layer and reused for the next layers."""

from __future__ import annotations

import pytest
import torch

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from trainer.hf import loading


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_moe(tmp_path_factory.mktemp("tiny"),
                          TinyMoeConfig(num_layers=4, first_k_dense=1))
    ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return path, {k: v.detach() for k, v in ref.state_dict().items()}


def test_every_tensor_equals_from_pretrained_and_layouts_are_reused(tiny):
    path, ref = tiny
    model = loading.build_meta(path, "sdpa")
    reader, plans = loading.SafetensorsReader(path), loading.Plans()
    for key, t in model.named_parameters():
        got = loading.read_local(model, reader, key, t, plans)
        assert torch.equal(got.float(), ref[key].float()), key
    fused = [k for k, _ in model.named_parameters() if ".experts." in k]
    assert len(fused) == 3 * 2  # gate_up_proj and down_proj of 3 MoE layers
    assert plans.walks == 2  # one walk each; the other layers reuse its layout
    assert all(v is not None for v in plans.known.values())  # fused experts: contiguous


def test_a_ranks_rows_of_a_fused_tensor(tiny, monkeypatch):
    path, ref = tiny
    model = loading.build_meta(path, "sdpa")
    reader, plans = loading.SafetensorsReader(path), loading.Plans()
    monkeypatch.setattr(loading, "local_rows", lambda t: (3, 6))  # experts 3..5
    for layer in (1, 2, 3):
        key = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        t = dict(model.named_parameters())[key]
        got = loading.read_local(model, reader, key, t, plans)
        assert torch.equal(got.float(), ref[key][3:6].float()), key
    assert plans.walks == 1


def test_a_scattered_layout_is_walked_every_time(tiny):
    # a source whose elements do not fill one contiguous run: no plan, the general walk
    ix = torch.arange(12, dtype=torch.int32).reshape(3, 4).t().contiguous()  # transposed
    assert loading._blocks("", {"w": ix}, 0, 12) is None
    assert loading._blocks("", {"w": torch.arange(12).reshape(3, 4)}, 4, 8) == [
        loading.Block("w", 4, 8, 0)]
