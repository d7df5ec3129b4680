"""Every benchmark runs in `make test`, so that one can break only loudly (issue 34).

Each bench script (tests/bench/*.py: the `make bench-*` targets and what scripts/gpu_run.sh runs
on a CPU) has a `--smoke` mode: tiny sizes, one repeat, seconds. Here each runs as its own
process, as `make bench-*` runs it, and the JSON it writes must hold the keys that BENCHMARKS.md
and other tools read; the figures themselves mean nothing at these sizes. The trainer and
families benches score the session's vLLM-CPU rollouts (conftest.real_moe_rollouts, shared with
test_trainer_vllm) instead of sampling their own. The runs go two at a time (a 2-core box:
most of each is one core's imports and process starts), started together for the selected tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from services.local.procs import kill_group

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
PARALLEL = 2
RUN_TIMEOUT_S = 480  # a smoke run takes 10-100 s on CI's 2 cores

# bench -> (script, extra arguments, keys its JSON must hold). `{rollouts}`/`{model}`: the
# session's vLLM-CPU rollouts and their model.
BENCHES: dict[str, tuple[str, list[str], list[str]]] = {
    "codec": ("bench_codec.py", [], ["uniform", "skewed", "informational", "meta", "ab"]),
    "constriction": ("bench_constriction.py", [], ["meta", "results"]),
    "store": ("bench_store.py", [], [
        "store_tokens_per_s", "raw_tokens_per_s", "throughput_ratio", "bytes_per_token_ratio",
        "store_header_tokens_per_s", "store_process_cpu_us_per_token",
        "cpu_us_per_token_by_process", "encode_cpu_us_per_token"]),
    "rollout": ("bench_rollout.py", [], [
        "tokens_per_s_off", "tokens_per_s_capture", "tokens_per_s_streaming",
        "capture_overhead", "streaming_overhead", "capture_overhead_cpu",
        "streaming_overhead_cpu", "store_trajectories_appended", "workload"]),
    "trainer": ("bench_trainer.py", ["--rollouts", "{rollouts}", "--model-dir", "{model}"], [
        "replay_overhead_ratio", "replay_overhead_ratio_cpu_time", "logprob_diff_ratio",
        "natural_router_agreement", "routing_mismatch_by_layer", "diff_r3_own_match",
        "r3_trainer_bf16_vs_fp32_mean", "r3_vllm_bf16_vs_fp32_same_weights_mean", "model"]),
    "weights": ("bench_weights.py", [], [
        "push_s_median", "raw_s_median", "ratio_to_raw", "push_gb_s", "push_phases_s_median",
        "passes_median", "cpu_s_median", "load_model", "load_verified"]),
    "hf": ("bench_hf_replay.py", [], ["runs", "replay_overhead_ratio", "machine"]),
    "families": ("bench_families.py", ["--rollouts", "{rollouts}", "--model-dir", "{model}"],
                 ["family", "backend", "logprob_diff_mean_off", "logprob_diff_mean_r3",
                  "ratio_r3_over_off", "routing_agreement"]),
    "megatron_parallel": ("bench_megatron_parallel.py", [], [
        "step_seconds", "tokens_per_s_per_gpu", "mfu", "r3_over_off", "r2_over_off",
        "peak_gib_per_rank", "plan_gib_no_overhead", "recompute_plan"]),
    "hf_parallel": ("bench_hf_parallel.py", [], [
        "off", "r3", "r3_over_off", "peak_gib_per_rank", "device"]),
    "push_stream": ("bench_push_stream.py", [], ["device", "layers", "mode", "rows"]),
    "vllm_gpu": ("bench_vllm_gpu.py", [], ["vllm", "engine", "compare"]),
    "long": ("bench_long.py", [], ["layout", "runs"]),
}
NEEDS_ROLLOUTS = {"trainer", "families"}


def _run(name: str, out: Path, subs: dict[str, str]) -> subprocess.CompletedProcess:
    script, extra, _ = BENCHES[name]
    args = [a.format(**subs) for a in extra]
    if name == "codec":  # the same-run A/B against a git revision: this checkout's HEAD
        args += ["--baseline-rev", "HEAD"]
    # One OpenMP thread (torch): two runs share the box, and spin-waiting threads would be most
    # of their CPU time; vLLM-CPU binds its own threads.
    env = os.environ | ({} if name == "rollout" else {"OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-X", "faulthandler", f"tests/bench/{script}", "--smoke", "--out",
           str(out), *args]
    # Its own process group: a run past its time is ended with everything it started (a vLLM
    # engine left behind would slow the rest of the suite), after SIGABRT has made faulthandler
    # print where each of its threads was, which the failure then shows (the rollout bench
    # once ran past 600 s on CI, and nothing said where).
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        if name == "rollout":  # where its asyncio tasks wait (bench_rollout.print_tasks_...)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
        proc.send_signal(signal.SIGABRT)
        time.sleep(3)
        with contextlib.suppress(ProcessLookupError):
            kill_group(proc.pid)  # and its /dev/shm files
        output, _ = proc.communicate()  # all it wrote (kept across the time-out)
        output += f"\n[ran past {RUN_TIMEOUT_S} s: ended]"
    with contextlib.suppress(ProcessLookupError):  # what it started and left behind
        kill_group(proc.pid)  # and its /dev/shm files
    return subprocess.CompletedProcess(cmd, proc.returncode, output, "")


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> Iterator[dict[str, tuple[Future, Path]]]:
    """The selected benches' smoke runs, started together, PARALLEL at a time."""
    chosen = [item.callspec.params["bench"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]
    subs = {}
    if NEEDS_ROLLOUTS & set(chosen):
        model, _ = request.getfixturevalue("real_moe_rollouts")
        subs = {"model": str(model), "rollouts": str(model.parent / "r.npz")}
    root = tmp_path_factory.mktemp("bench-smoke")
    pool = ThreadPoolExecutor(PARALLEL)
    futures = {name: pool.submit(_run, name, root / f"{name}.json", subs) for name in chosen}
    yield {name: (futures[name], root / f"{name}.json") for name in chosen}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("bench", list(BENCHES))
def test_bench_smoke_writes_its_keys(bench, smoke_runs):
    future, out = smoke_runs[bench]
    proc = future.result()
    tail = proc.stdout[-6000:]
    assert proc.returncode == 0, f"{BENCHES[bench][0]} --smoke exited {proc.returncode}:\n{tail}"
    data = json.loads(out.read_text())
    row = data[0] if isinstance(data, list) else data  # bench_families: one row per family
    missing = [k for k in BENCHES[bench][2] if k not in row]
    assert not missing, f"{out.name} lacks {missing}"
    if bench == "weights":
        assert row["load_verified"], "the pushed weights did not load back"
    if bench == "push_stream":  # every tensor of the packed push checked on both receivers
        assert all(not r["bad"] and not r["missing"] and min(r["checked"]) == r["tensors"]
                   for r in row["rows"]), row["rows"]
    if bench == "vllm_gpu":  # the engine's self-check and its capture against HF (fp32)
        assert row["engine"]["self_check"] == "passed" and row["engine"]["all_zero_rows"] == 0
        assert row["compare"]["eager_vs_hf"]["agree"] == 1.0, row["compare"]
        # routing at finish = vLLM's per-step rows, on the same calls (issue 53)
        assert row["engine"]["delivery"]["equal"], row["engine"]["delivery"]
    if bench == "long":  # store + trainer path: every process within its peak-RSS bound
        assert_long_rss_bounds(data)
    if isinstance(data, dict) and "smoke" in data:
        assert data["smoke"] is True


MiB = 1 << 20


def assert_long_rss_bounds(data: dict) -> None:
    """bench_long's stated bounds (docs/benchmarks/long-rollouts.md "The bounds, as measured"):
    each process's peak over its own baseline is a constant plus what it must hold of the
    group (its wire bytes W; the trainer also the group's decoded uint8 ids), never the whole
    group as int64. Constants ~3x the smoke's growth on a loaded 2-core box (client 6, store 5,
    trainer 16, redis 6 MiB at 512 tokens): a leak or a copy per segment or chunk goes over
    them; an O(trajectory) term this short (the group as int64: 12 MiB) does not, that is the
    8k-128k runs' of `make bench-long`."""
    for r in data["runs"]:
        wire, layout = r["wire_bytes"], data["layout"]
        decoded = layout["group"] * r["tokens"] * layout["layers"] * layout["topk"]
        grew = {"client": r["client_peak"] - r["client_base"],
                "store": r["store_peak"] - r["store_base"],
                "trainer": r["trainer_peak"] - r["trainer_base"]}
        bound = {"client": 32 * MiB, "store": 48 * MiB + 5 * wire,
                 "trainer": 48 * MiB + 3 * wire + decoded}
        over = {k: f"{grew[k] / MiB:.1f} > {bound[k] / MiB:.1f} MiB" for k in grew
                if grew[k] > bound[k]}
        assert not over, f"{r['tokens']} tokens: peak RSS over its bound: {over}"
        assert r["redis_peak"] < 32 * MiB + 3 * wire, f"redis peak {r['redis_peak'] / MiB:.1f} MiB"


def test_bench_local_smoke(tmp_path: Path):
    """`make bench-local --smoke`: the main job's first 2 steps (tests' small MoE, no
    Prometheus), this tree only; the figures BENCHMARKS.md records are in its JSON (issue 46)."""
    out = tmp_path / "local.json"
    proc = subprocess.run([sys.executable, "tests/bench/bench_local.py", "--smoke", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["smoke"] is True and data["baseline_rev"] is None
    (run,) = data["runs"]
    assert run["steps"] == 2 and data["steps_per_s"] == run["steps_per_s"] > 0, run
    assert 0 < run["trainer_busy_share"] <= 1.0, run
    assert run["rollout_cpu_cores"] > 0 and run["trainer_cpu_cores"] > 0, run
    assert {"update_seconds", "old_pass_seconds", "batch_wait_seconds"} <= \
        set(run["mean_pass_seconds"]), run["mean_pass_seconds"]
