"""Trajectory store benchmark (`make bench-store`): the store vs raw redis-py pipelines.

Workload (issue 3): 4 client processes stream trajectories of 1,024 tokens (512 prompt + 512
response, groups of 8 sharing a prompt) with Qwen3-30B-A3B-shaped routing (48 layers, top-8 of
128, `skewed` generator) through gRPC; one puller drains the groups and acks them.
Baseline in the same run: the same payloads uncompressed (uint8 routing + int32 tokens +
float32 logprobs) written by 4 processes with redis-py pipelines and read back by one reader.

Each side runs against its own fresh embedded redis-server (AOF everysec) in two timed phases:
write (all clients at once), then drain. tokens/s = tokens / (write s + drain s). Memory is
Redis INFO used_memory after the write phase minus before, per token. Trajectory protos
(routing encoded by the codec) are built before the clock starts: encoding is the rollout
worker's work, overlapped with generation; its cost is printed separately.
Legend: T = routing rows, L = layers, K = top-k.
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

import numpy as np
import redis

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests/bench")]

from routing_data import skewed_routing  # noqa: E402

from services.store.redis_server import EmbeddedRedis, free_port  # noqa: E402

CLIENTS, GROUP, PROMPT, RESPONSE = 4, 8, 512, 512
LAYERS, TOPK, EXPERTS = 48, 8, 128
TOKENS_PER_TRAJ = PROMPT + RESPONSE


def group_arrays(seed: int) -> list[dict[str, np.ndarray]]:
    """One GRPO group: shared prompt tokens/routing, per-member response tokens/routing."""
    rng = np.random.default_rng(seed)
    prompt_TLK = skewed_routing(PROMPT, LAYERS, TOPK, EXPERTS, seed=seed)
    resp_TLK = skewed_routing(GROUP * (RESPONSE - 1), LAYERS, TOPK, EXPERTS, seed=seed + 1)
    prompt_ids = rng.integers(0, 150_000, PROMPT, dtype=np.int32)
    out = []
    for i in range(GROUP):
        out.append({
            "prompt_ids": prompt_ids, "prompt_TLK": prompt_TLK,
            "resp_TLK": resp_TLK[i * (RESPONSE - 1):(i + 1) * (RESPONSE - 1)],
            "token_ids": rng.integers(0, 150_000, RESPONSE, dtype=np.int32),
            "logprobs": -rng.random(RESPONSE, dtype=np.float32)})
    return out


def generate_data(groups: int, workdir: Path) -> Path:
    """Generate every client's groups once (both sides replay the same arrays)."""
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    seeds = [1000 * c + g for c in range(CLIENTS) for g in range(groups)]
    with mp.get_context("spawn").Pool(min(4, os.cpu_count() or 1)) as pool:
        pool.starmap(_save_group, [(seed, data) for seed in seeds])
    return data


def _save_group(seed: int, data: Path) -> None:
    members = group_arrays(seed)
    np.savez(data / f"{seed}.npz", **{f"{i}:{k}": v for i, m in enumerate(members)
                                      for k, v in m.items()})


def load_group(data: Path, seed: int) -> list[dict[str, np.ndarray]]:
    z = np.load(data / f"{seed}.npz")
    out: list[dict[str, np.ndarray]] = [{} for _ in range(GROUP)]
    for name in z.files:
        i, k = name.split(":")
        out[int(i)][k] = z[name]
    return out


def to_trajectory(tid: str, gid: str, a: dict[str, np.ndarray]):  # noqa: ANN201
    from services.common.pb.r3flow.v1 import trajectory_pb2
    from services.common.wire import routing_to_proto

    layer_ids = list(range(LAYERS))
    seg = trajectory_pb2.Segment(index=0, token_ids=a["token_ids"].tolist(),
                                 logprobs=a["logprobs"].tolist(), loss_mask=b"\x01" * RESPONSE)
    seg.routing.append(routing_to_proto(a["prompt_TLK"], EXPERTS, start_row=0,
                                        layer_ids=layer_ids))
    seg.routing.append(routing_to_proto(a["resp_TLK"], EXPERTS, start_row=PROMPT,
                                        layer_ids=layer_ids))
    return trajectory_pb2.Trajectory(
        trajectory_id=tid, group_id=gid, group_size=GROUP,
        prompt_token_ids=a["prompt_ids"].tolist(), segments=[seg], reward=1.0,
        finish_reason=trajectory_pb2.FINISH_REASON_STOP)


def raw_payload(a: dict[str, np.ndarray]) -> bytes:
    routing = np.concatenate([a["prompt_TLK"], a["resp_TLK"]]).astype(np.uint8)
    return (a["prompt_ids"].tobytes() + a["token_ids"].tobytes() + a["logprobs"].tobytes()
            + routing.tobytes())


# ---- client processes --------------------------------------------------------------------
def store_client(idx: int, groups: int, data: Path, address: str, ready, go, out) -> None:  # noqa: ANN001
    from services.store.client import StoreClient

    t0 = time.perf_counter()
    trajs = [to_trajectory(f"c{idx}g{g}m{i}", f"c{idx}g{g}", a)
             for g in range(groups) for i, a in enumerate(load_group(data, 1000 * idx + g))]
    build_s = time.perf_counter() - t0
    with StoreClient(address, timeout_s=120) as client:
        ready.put(idx)
        go.wait()
        start = time.time()
        for traj in trajs:
            client.append_trajectory(traj)
        out.put({"start": start, "end": time.time(), "build_s": build_s})


def raw_client(idx: int, groups: int, data: Path, url: str, ready, go, out) -> None:  # noqa: ANN001
    t0 = time.perf_counter()
    payloads = [(f"raw:c{idx}g{g}m{i}", raw_payload(a))
                for g in range(groups) for i, a in enumerate(load_group(data, 1000 * idx + g))]
    build_s = time.perf_counter() - t0
    r = redis.Redis.from_url(url)
    ready.put(idx)
    go.wait()
    start = time.time()
    for k in range(0, len(payloads), GROUP):  # one pipeline per group, like one Append batch
        with r.pipeline(transaction=False) as p:
            for key, blob in payloads[k:k + GROUP]:
                p.set(key, blob)
                p.rpush("raw:queue", key)
            p.execute()
    out.put({"start": start, "end": time.time(), "build_s": build_s})


def run_writers(target, groups: int, data: Path, arg: str) -> tuple[float, float]:  # noqa: ANN001
    """Start CLIENTS processes, release them together; returns (write seconds, build s)."""
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=target, args=(i, groups, data, arg, ready, go, out))
             for i in range(CLIENTS)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    go.set()
    results = [out.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"writer exited with {p.exitcode}"
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    return span, max(r["build_s"] for r in results)


# ---- drain -------------------------------------------------------------------------------
def drain_store(address: str, n_groups: int) -> float:
    from services.store.client import StoreClient

    t0, seen = time.perf_counter(), 0
    with StoreClient(address, timeout_s=120) as client:
        while seen < n_groups:
            groups = client.pull("bench", max_groups=4, lease_seconds=600, wait_ms=1000)
            assert all(len(g.trajectories) == GROUP for g in groups)
            client.ack("bench", [g.delivery_id for g in groups])
            seen += len(groups)
    return time.perf_counter() - t0


def drain_raw(url: str, n_trajs: int) -> float:
    r, t0, seen = redis.Redis.from_url(url), time.perf_counter(), 0
    while seen < n_trajs:
        keys = r.lpop("raw:queue", GROUP) or []
        with r.pipeline(transaction=False) as p:
            for key in keys:
                p.get(key)
                p.delete(key)
            blobs = p.execute()[::2]
        assert all(len(b) == len(blobs[0]) for b in blobs)
        seen += len(keys)
    return time.perf_counter() - t0


def used_memory(url: str) -> int:
    return int(redis.Redis.from_url(url).info("memory")["used_memory"])


# ---- the two sides -------------------------------------------------------------------------
def bench_store(groups: int, data: Path, workdir: Path) -> dict[str, float]:
    with EmbeddedRedis(workdir / "store-redis") as server:
        port = free_port()
        cfg = workdir / "store.json"
        cfg.write_text(json.dumps({"max_backlog_tokens": 1 << 40, "max_policy_lag": None}))
        env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([sys.executable, "-m", "services.store.cli", "--config", str(cfg),
                                 "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"],
                                cwd=REPO, env=env)
        try:
            from services.store.client import StoreClient

            StoreClient(f"127.0.0.1:{port}").wait_ready(60)
            mem0 = used_memory(server.url)
            write_s, build_s = run_writers(store_client, groups, data, f"127.0.0.1:{port}")
            mem = used_memory(server.url) - mem0
            drain_s = drain_store(f"127.0.0.1:{port}", CLIENTS * groups)
        finally:
            proc.kill()
            proc.wait()
    return {"write_s": write_s, "drain_s": drain_s, "mem_bytes": mem, "build_s": build_s}


def bench_raw(groups: int, data: Path, workdir: Path) -> dict[str, float]:
    with EmbeddedRedis(workdir / "raw-redis") as server:
        mem0 = used_memory(server.url)
        write_s, build_s = run_writers(raw_client, groups, data, server.url)
        mem = used_memory(server.url) - mem0
        drain_s = drain_raw(server.url, CLIENTS * groups * GROUP)
    return {"write_s": write_s, "drain_s": drain_s, "mem_bytes": mem, "build_s": build_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups-per-client", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "bench-results/store.json"))
    args = parser.parse_args()
    tokens = CLIENTS * args.groups_per_client * GROUP * TOKENS_PER_TRAJ
    with tempfile.TemporaryDirectory() as tmp:
        data = generate_data(args.groups_per_client, Path(tmp))
        raw = bench_raw(args.groups_per_client, data, Path(tmp))
        store = bench_store(args.groups_per_client, data, Path(tmp))
    result = summarize(tokens, store, raw)
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def summarize(tokens: int, store: dict[str, float], raw: dict[str, float]) -> dict[str, object]:
    def rate(side: dict[str, float]) -> float:
        return tokens / (side["write_s"] + side["drain_s"])

    return {
        "tokens": tokens, "clients": CLIENTS, "group_size": GROUP,
        "shape": {"prompt": PROMPT, "response": RESPONSE, "layers": LAYERS, "topk": TOPK,
                  "num_experts": EXPERTS, "generator": "skewed"},
        "store_tokens_per_s": rate(store), "raw_tokens_per_s": rate(raw),
        "throughput_ratio": rate(store) / rate(raw),
        "store_bytes_per_token": store["mem_bytes"] / tokens,
        "raw_bytes_per_token": raw["mem_bytes"] / tokens,
        "bytes_per_token_ratio": store["mem_bytes"] / raw["mem_bytes"],
        "store": store, "raw": raw, "cpu_count": os.cpu_count()}


def print_table(r: dict) -> None:  # noqa: ANN001
    print(f"{'side':<8}{'write s':>10}{'drain s':>10}{'tokens/s':>14}{'bytes/token':>14}")
    for side in ("raw", "store"):
        s = r[side]
        print(f"{side:<8}{s['write_s']:>10.2f}{s['drain_s']:>10.2f}"
              f"{r[side + '_tokens_per_s']:>14,.0f}{r[side + '_bytes_per_token']:>14,.1f}")
    print(f"throughput_ratio {r['throughput_ratio']:.3f} (target >= 0.5)   "
          f"bytes_per_token_ratio {r['bytes_per_token_ratio']:.3f} (target <= 0.5)   "
          f"tokens {r['tokens']:,}")
    print(f"(proto build incl. codec encode, before the clock: {r['store']['build_s']:.1f}s "
          "per client)")


if __name__ == "__main__":
    main()
