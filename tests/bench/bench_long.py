"""Long-rollout memory benchmark (`make bench-long`, issue 54): peak RSS of every process when
one GRPO group of long trajectories with routing goes rollout -> store -> trainer batch -> replay.

Workload per length (default 8k, 32k and 128k tokens, prompt + response): a group of 8
trajectories at Qwen3-30B-A3B's routing layout (48 MoE layers, top-8 of 128 experts, `skewed`
synthetic routing). Processes, each measured by its own peak RSS (VmHWM):
  * redis: an embedded redis-server (AOF everysec) on loopback;
  * store: `services.store.cli` (gRPC, routing_validation=decode) on loopback;
  * client: stands in for the rollout worker's append path: a begin message, then one Append
    stream per segment of `--segment-tokens` response tokens (its routing in chunks of at most
    `--chunk-rows` rows, encoded by the codec), then the finish. It never holds more than one
    segment: it measures the wire and store path, not vLLM's own capture buffers;
  * trainer: pulls the group, decodes it into samples (r3,
    `trainer.samples.intake.intake_groups`), cuts micro-batches of one sample moved to the
    trainer's device as each is built (`split_microbatches(..., device)`, as both engines do;
    `--device meta` stands in for a GPU: what moves there leaves the host) and builds each
    micro-batch's replay ids in router order (`to_router_rows`), one micro-batch at a time;
    `dev/mb` is their size on the device.
Synthetic routing is drawn once (`--chunk-rows` rows) and every chunk re-uses its encoding
(start_row differs): sizes are those of real skewed routing, generation costs nothing per token.
Writes bench-results/long.json and prints a table (MiB). Legend: T rows, L layers, K top-k.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from services.common.net import free_port  # noqa: E402
from services.common.procenv import pythonpath  # noqa: E402
from services.store.redis_server import EmbeddedRedis  # noqa: E402

LAYERS, TOPK, EXPERTS, GROUP = 48, 8, 128, 8
MiB = 1 << 20


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
                      response: int, seg_tokens: int, chunk_rows: int) -> None:
    import numpy as np

    from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2

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
        client.append([store_pb2.AppendRequest(trajectory_id=tid, sequence_number=j + 1,
                                               segment=seg)])
        del seg
    finish = store_pb2.TrajectoryFinish(num_segments=len(plan), reward=float(rng.random()),
                                        finish_reason=trajectory_pb2.FINISH_REASON_STOP)
    client.append([store_pb2.AppendRequest(trajectory_id=tid, sequence_number=len(plan) + 1,
                                           finish=finish)])


def rollout_client(address: str, tokens: int, seg_tokens: int, chunk_rows: int,
                   out) -> None:  # noqa: ANN001
    from services.store.client import StoreClient

    prompt = max(2, tokens // 8)
    pool = ChunkPool(chunk_rows)
    base = current_rss()
    t0 = time.perf_counter()
    with StoreClient(address, timeout_s=600) as client:
        for i in range(GROUP):
            append_trajectory(client, pool, f"t{tokens}m{i}", f"g{tokens}", prompt,
                              tokens - prompt, seg_tokens, chunk_rows)
    out.put({"client_base": base, "client_peak": peak_rss(),
             "append_s": time.perf_counter() - t0})


# ---- the trainer's side ----------------------------------------------------------------------
def trainer_consumer(address: str, device: str, out) -> None:  # noqa: ANN001
    import torch

    from services.store.client import StoreClient
    from trainer.replay import ReplayMode
    from trainer.samples.alignment import LayerMap, to_router_rows
    from trainer.samples.batch import split_microbatches
    from trainer.samples.intake import intake_groups

    torch.set_num_threads(1)
    base, marks, t0 = current_rss(), {}, time.perf_counter()
    with StoreClient(address, timeout_s=600) as client:
        groups: list = []
        while not groups:
            groups = client.pull("bench-long", max_groups=1, lease_seconds=600, wait_ms=5000)
        marks["pulled"] = peak_rss()
        samples, dropped = intake_groups(groups, ReplayMode.R3,
                                         lambda ids: LayerMap.build(range(LAYERS), ids),
                                         EXPERTS, TOPK)
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
def run_length(tokens: int, seg_tokens: int, chunk_rows: int, device: str, workdir: Path
               ) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with EmbeddedRedis(workdir / f"redis-{tokens}") as server:
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
            store_base = peak_rss(store.pid)
            writer = ctx.Process(target=rollout_client,
                                 args=(address, tokens, seg_tokens, chunk_rows, out))
            writer.start()
            res = out.get(timeout=3600)
            writer.join()
            assert writer.exitcode == 0, f"client exited with {writer.exitcode}"
            reader = ctx.Process(target=trainer_consumer, args=(address, device, out))
            reader.start()
            res |= out.get(timeout=3600)
            reader.join()
            assert reader.exitcode == 0, f"trainer exited with {reader.exitcode}"
            res |= {"store_base": store_base, "store_peak": peak_rss(store.pid),
                    "redis_peak": peak_rss(server.pid)}  # type: ignore[arg-type]
        finally:
            store.kill()
            store.wait()
    return {"tokens": tokens, **res}


def print_table(rows: list[dict]) -> None:
    print(f"{'tokens':>8}{'client':>9}{'store':>9}{'redis':>9}{'trainer':>9}"
          f"{'(pulled':>9}{'samples':>9}{'mbs':>9}{'replay)':>9}{'wire':>8}{'dev/mb':>8}")
    for r in rows:
        m = r["trainer_marks"]
        print(f"{r['tokens']:>8}" + "".join(f"{v / MiB:>9.0f}" for v in (
            r["client_peak"], r["store_peak"], r["redis_peak"], r["trainer_peak"],
            m["pulled"], m["samples"], m["microbatches"], m["replay"]))
            + f"{r['wire_bytes'] / MiB:>8.0f}{r['replay_ids_bytes_per_microbatch'] / MiB:>8.0f}")
    b = rows[0]
    print(f"baselines after imports (MiB): client {b['client_base'] / MiB:.0f}, store "
          f"{b['store_base'] / MiB:.0f}, trainer {b['trainer_base'] / MiB:.0f}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072],
                   help="prompt + response tokens per trajectory (one run each)")
    p.add_argument("--segment-tokens", type=int, default=4096,
                   help="response tokens per appended segment (one Append stream each)")
    p.add_argument("--chunk-rows", type=int, default=4096,
                   help="routing rows per RoutedExperts chunk")
    p.add_argument("--device", default="meta", help="the trainer's device: `meta` stands in for "
                   "a GPU (micro-batches leave the host, nothing is allocated), `cpu` is the CPU "
                   "backend (every micro-batch's int64 ids stay on the host)")
    p.add_argument("--smoke", action="store_true", help="make test's run: 512 tokens")
    p.add_argument("--out", default=str(REPO / "bench-results/long.json"))
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.segment_tokens, args.chunk_rows = [512], 128, 128
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.tokens:
            rows.append(run_length(n, args.segment_tokens, args.chunk_rows, args.device,
                                   Path(tmp)))
            print(f"{n} tokens done: {json.dumps(rows[-1])}", flush=True)
    print_table(rows)
    result = {"layout": {"layers": LAYERS, "topk": TOPK, "num_experts": EXPERTS,
                         "group": GROUP, "generator": "skewed"},
              "segment_tokens": args.segment_tokens, "chunk_rows": args.chunk_rows,
              "smoke": args.smoke, "device": args.device, "runs": rows,
              "load_avg_1m": os.getloadavg()[0],
              "cpu_count": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
