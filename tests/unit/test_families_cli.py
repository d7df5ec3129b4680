"""`r3flow model tiny-moe --family NAME` builds that family (services/rollout/model_cli.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from services.rollout import model_cli


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    model_cli.add_arguments(p)
    return p.parse_args(["tiny-moe", *argv])


def test_family_flag_builds_that_family_with_the_local_tokenizer(tmp_path):
    out = tmp_path / "m"
    assert model_cli.run(_args("--family", "mixtral", "--out", str(out),
                               "--set", "num_layers=1")) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_hidden_layers"] == 1
    assert (out / "tokenizer.json").exists() and list(out.glob("*.safetensors"))


def test_default_family_is_qwen3_moe(tmp_path):
    assert model_cli.run(_args("--out", str(tmp_path), "--set", "num_layers=1")) == 0
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_unknown_family_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="family: 'llama' is not one of qwen3_moe, qwen2_moe"):
        model_cli.run(_args("--family", "llama", "--out", str(tmp_path)))
