"""Checkpoints with multi-token-prediction layers (DeepSeek-V3, GLM-4.5: HF
num_nextn_predict_layers > 0): refused at boot on both backends unless drop_mtp says to train the
main model without them."""

import json

import pytest

from trainer.backend import check_mtp, make_backend
from trainer.config import TrainerConfig


def _checkpoint(tmp_path, mtp: int):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v3", "num_nextn_predict_layers": mtp}))
    return str(tmp_path)


@pytest.mark.parametrize("backend", ["megatron", "hf"])
def test_mtp_checkpoint_is_refused_at_boot_naming_the_field(tmp_path, backend):
    cfg = TrainerConfig(model_dir=_checkpoint(tmp_path, 1), backend=backend)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers: the checkpoint has 1 "
                       r"multi-token-prediction layer\(s\) .* set drop_mtp: true"):
        make_backend(cfg)  # refused before any model or process group is built


def test_drop_mtp_lets_it_through_and_no_mtp_needs_nothing(tmp_path):
    check_mtp(TrainerConfig(model_dir=_checkpoint(tmp_path, 1), drop_mtp=True))
    check_mtp(TrainerConfig(model_dir=_checkpoint(tmp_path, 0)))
