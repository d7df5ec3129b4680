"""Issue 55's bench tools on the CPU: bench_megatron_parallel's --variants (each variant is the
base command line with its own arguments appended, named, in order; a bad name refused) and
tests/bench/trace_summary.py on a hand-made chrome trace (idle, gaps, host syncs, and GPU time
by the frame that launched each kernel, backward kernels by their autograd node)."""

from __future__ import annotations

import gzip
import json

import pytest

from tests.bench import bench_megatron_parallel as bench_mp
from tests.bench import trace_summary


def test_variants_append_their_arguments_in_order():
    p = bench_mp.parser()
    base = ["--gpus", "1", "--ep", "1", "--micro-batch", "2", "--variants",
            "a:;b:--moe-permute gather --batch-first-logits;c:--samples 4 --skip-old-pass off"]
    got = bench_mp._variants(p, base)
    assert [n for n, _ in got] == ["a", "b", "c"]
    a, b, c = (v for _, v in got)
    assert (a.moe_permute, a.batch_first_logits, a.samples) == (None, None, 2)
    assert (b.moe_permute, b.batch_first_logits, b.micro_batch) == ("gather", True, 2)
    assert (c.samples, c.skip_old_pass, c.moe_permute) == (4, "off", None)
    only = bench_mp._variants(p, ["--gpus", "1"])
    assert [n for n, _ in only] == [""]
    with pytest.raises(SystemExit, match="is not a name"):
        bench_mp._variants(p, ["--variants", "a b:--samples 4"])


def _x(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
            "args": args}


def test_trace_summary_idle_gaps_and_launch_frames(tmp_path):
    events = [
        _x("python_function", "megatron/core/transformer/moe/moe_utils.py(337): permute", 0, 60, 1),
        _x("cpu_op", "aten::index_select", 5, 20, 1),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, 1, correlation=7),
        _x("cuda_runtime", "cudaStreamSynchronize", 30, 40, 1, correlation=8),
        _x("cpu_op", "autograd::engine::evaluate_function: IndexSelectBackward0", 100, 30, 2),
        _x("cuda_runtime", "cudaLaunchKernel", 105, 5, 2, correlation=9),
        _x("kernel", "index_select_kernel", 20, 10, 7, correlation=7),
        _x("kernel", "index_add_kernel", 150, 30, 7, correlation=9),
    ]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    text = trace_summary.summarise(str(path))
    assert "wall 0.2 ms" in text and "GPU busy 0.0 ms" in text  # 180 us of wall, 40 busy
    assert "idle 0.1 ms (77.8% of the wall)" in text
    assert "gaps 1 totalling 0.1 ms; > 20 us: 1" in text  # 30 -> 150 us
    assert "cudaStreamSynchronize x1" in text
    lines = text.splitlines()
    where = lines[lines.index("-- GPU time by where it was launched (kernels, ms, share of "
                              "busy)") + 1:]
    assert any(ln.endswith("bwd node IndexSelectBackward0") and "75.0%" in ln for ln in where)
    assert any(ln.endswith("permute (dispatch)") and "25.0%" in ln for ln in where)
