"""Trajectory store benchmark (`make bench-store`): the store vs raw redis-py pipelines.

Workload (issue 3): 4 client processes stream trajectories of 1,024 tokens (512 prompt + 512
response, groups of 8 sharing a prompt) with Qwen3-30B-A3B-shaped routing (48 layers, top-8 of
128, `skewed` generator) through gRPC; one puller drains the groups and acks them.
Baseline in the same run: the same payloads uncompressed (uint8 routing + int32 tokens +
float32 logprobs) written by 4 processes with redis-py pipelines and read back by one reader.

Each side runs against its own fresh embedded redis-server (AOF everysec) in two timed phases:
write (all clients at once), then drain. tokens/s = tokens / (write s + drain s); the sides
run interleaved `--repeats` times and the MEDIAN run of each is compared (the machine is shared;
a best-of favours the side with the shorter, noisier runs: the raw baseline's write phase is
~0.2 s at the default size). The best runs are reported too.
Memory is Redis INFO used_memory (less AOF and client buffers) after the write phase minus
before, per token. Trajectory protos
(routing encoded by the codec) are built before the clock starts: encoding is the rollout
worker's work, overlapped with generation; its cost is printed separately.
Legend: T = routing rows, L = layers, K = top-k.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from services.common.net import free_port  # noqa: E402
from services.common.procenv import pythonpath  # noqa: E402
from services.store.redis_server import EmbeddedRedis  # noqa: E402
from tests.bench.routing_data import skewed_routing  # noqa: E402

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


def generate_data(groups: int, workdir: Path, clients: int = CLIENTS) -> Path:
    """Generate every client's groups once (both sides replay the same arrays)."""
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    seeds = [1000 * c + g for c in range(clients) for g in range(groups)]
    with mp.get_context("spawn").Pool(min(4, os.cpu_count() or 1, len(seeds))) as pool:
        pool.starmap(_save_group, [(seed, data) for seed in seeds])
    return data


def _save_group(seed: int, data: Path) -> None:
    members = group_arrays(seed)
    np.savez(data / f"{seed}.npz", **{f"{i}:{k}": v for i, m in enumerate(members)
                                      for k, v in m.items()})
    # The rollout worker's side (routing encode) is done once, here, off the clock.
    t0 = time.process_time()
    blobs = [to_trajectory(f"s{seed}m{i}", f"s{seed}", a).SerializeToString()
             for i, a in enumerate(members)]
    (data / f"{seed}.encode_s").write_text(str(time.process_time() - t0))
    (data / f"{seed}.pb").write_bytes(b"".join(len(b).to_bytes(4, "little") + b for b in blobs))


def load_trajectories(data: Path, seed: int) -> list:  # noqa: ANN201 (protobuf type)
    from services.common.pb.r3flow.v1 import trajectory_pb2

    raw, out, pos = (data / f"{seed}.pb").read_bytes(), [], 0
    while pos < len(raw):
        n = int.from_bytes(raw[pos:pos + 4], "little")
        out.append(trajectory_pb2.Trajectory.FromString(raw[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out


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

    groups_of_trajs = [load_trajectories(data, 1000 * idx + g) for g in range(groups)]
    with StoreClient(address, timeout_s=120) as client:
        ready.put(idx)
        go.wait()
        start, cpu0 = time.time(), time.process_time()
        for trajs in groups_of_trajs:  # one Append stream per finished group
            client.append_trajectories(trajs)
        out.put({"start": start, "end": time.time(), "cpu": time.process_time() - cpu0})


def raw_client(idx: int, groups: int, data: Path, url: str, ready, go, out) -> None:  # noqa: ANN001
    payloads = [(f"raw:c{idx}g{g}m{i}", raw_payload(a))
                for g in range(groups) for i, a in enumerate(load_group(data, 1000 * idx + g))]
    r = redis.Redis.from_url(url)
    ready.put(idx)
    go.wait()
    start, cpu0 = time.time(), time.process_time()
    for k in range(0, len(payloads), GROUP):  # one pipeline per group, like one Append batch
        with r.pipeline(transaction=False) as p:
            for key, blob in payloads[k:k + GROUP]:
                p.set(key, blob)
                p.rpush("raw:queue", key)
            p.execute()
    out.put({"start": start, "end": time.time(), "cpu": time.process_time() - cpu0})


def run_writers(target, groups: int, data: Path, arg: str,  # noqa: ANN001
                clients: int = CLIENTS) -> tuple[float, float]:
    """Start `clients` processes, release them together; returns (wall s, clients' CPU s)."""
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=target, args=(i, groups, data, arg, ready, go, out))
             for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    go.set()
    results = [out.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"writer exited with {p.exitcode}"
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return wall, sum(r["cpu"] for r in results)


# ---- drain -------------------------------------------------------------------------------
def drain_store(address: str, n_groups: int) -> tuple[float, float]:
    from services.store.client import StoreClient

    t0, cpu0, seen = time.perf_counter(), time.process_time(), 0
    with StoreClient(address, timeout_s=120) as client:
        while seen < n_groups:
            groups = client.pull("bench", max_groups=4, lease_seconds=600, wait_ms=1000)
            assert all(len(g.trajectories) == GROUP for g in groups)
            client.ack("bench", [g.delivery_id for g in groups])
            seen += len(groups)
    return time.perf_counter() - t0, time.process_time() - cpu0


def drain_raw(url: str, n_trajs: int) -> tuple[float, float]:
    r, t0, cpu0, seen = redis.Redis.from_url(url), time.perf_counter(), time.process_time(), 0
    while seen < n_trajs:
        keys = r.lpop("raw:queue", GROUP) or []
        with r.pipeline(transaction=False) as p:
            for key in keys:
                p.get(key)
                p.delete(key)
            blobs = p.execute()[::2]
        assert all(len(b) == len(blobs[0]) for b in blobs)
        seen += len(keys)
    return time.perf_counter() - t0, time.process_time() - cpu0


def used_memory(url: str) -> int:
    """INFO used_memory minus transient buffers (pending AOF writes, client I/O buffers), once
    no AOF rewrite runs (Redis starts one past 64 MB; its buffer would count as data)."""
    client = redis.Redis.from_url(url)
    for _ in range(600):
        p = client.info("persistence")
        if not (p["aof_rewrite_in_progress"] or p["aof_rewrite_scheduled"]):
            break
        time.sleep(0.05)
    info = client.info("memory")
    transient = info["mem_aof_buffer"] + info["mem_clients_normal"]
    return int(info["used_memory"]) - int(transient)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (contention-independent cost)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the two sides -------------------------------------------------------------------------
def bench_store(groups: int, data: Path, workdir: Path, routing_validation: str = "decode",
                clients: int = CLIENTS) -> dict[str, float]:
    with EmbeddedRedis(workdir / "store-redis") as server:
        port = free_port()
        cfg = workdir / "store.json"
        cfg.write_text(json.dumps({"max_backlog_tokens": 1 << 40, "max_policy_lag": None,
                                   "routing_validation": routing_validation}))
        env = {**os.environ, "REDIS_URL": server.url, "PYTHONPATH": pythonpath(REPO)}
        proc = subprocess.Popen([sys.executable, "-m", "services.store.cli", "--config", str(cfg),
                                 "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"],
                                cwd=REPO, env=env)
        try:
            from services.store.client import StoreClient

            StoreClient(f"127.0.0.1:{port}").wait_ready(60)
            mem0, cpu0 = used_memory(server.url), cpu_seconds(proc.pid)
            redis0 = cpu_seconds(server.pid)  # type: ignore[arg-type]
            write_s, client_cpu = run_writers(store_client, groups, data, f"127.0.0.1:{port}",
                                              clients)
            mem = used_memory(server.url) - mem0
            drain_s, drain_cpu = drain_store(f"127.0.0.1:{port}", clients * groups)
            store_cpu = cpu_seconds(proc.pid) - cpu0
            redis_cpu = cpu_seconds(server.pid) - redis0  # type: ignore[arg-type]
        finally:
            proc.kill()
            proc.wait()
    return {"write_s": write_s, "drain_s": drain_s, "mem_bytes": mem,
            "store_process_cpu_s": store_cpu, "client_cpu_s": client_cpu,
            "drain_cpu_s": drain_cpu, "redis_cpu_s": redis_cpu,
            "total_cpu_s": client_cpu + drain_cpu + store_cpu + redis_cpu}


def bench_raw(groups: int, data: Path, workdir: Path, clients: int = CLIENTS
              ) -> dict[str, float]:
    with EmbeddedRedis(workdir / "raw-redis") as server:
        mem0, redis0 = used_memory(server.url), cpu_seconds(server.pid)  # type: ignore[arg-type]
        write_s, client_cpu = run_writers(raw_client, groups, data, server.url, clients)
        mem = used_memory(server.url) - mem0
        drain_s, drain_cpu = drain_raw(server.url, clients * groups * GROUP)
        redis_cpu = cpu_seconds(server.pid) - redis0  # type: ignore[arg-type]
    return {"write_s": write_s, "drain_s": drain_s, "mem_bytes": mem,
            "client_cpu_s": client_cpu, "drain_cpu_s": drain_cpu, "redis_cpu_s": redis_cpu,
            "total_cpu_s": client_cpu + drain_cpu + redis_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups-per-client", type=int, default=8)
    parser.add_argument("--clients", type=int, default=CLIENTS, help="writer processes per side")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved runs per side; the medians are compared")
    parser.add_argument("--out", default=str(REPO / "bench-results/store.json"))
    parser.add_argument("--smoke", action="store_true",
                        help="make test's run: one client, one group, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.groups_per_client, args.repeats = 1, 1, 1
    n, k = args.groups_per_client, args.clients
    tokens = k * n * GROUP * TOKENS_PER_TRAJ
    runs: dict[str, list[dict[str, float]]] = {"raw": [], "store": [], "store_header": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = generate_data(n, Path(tmp), k)
        encode_s = sum(float(f.read_text()) for f in data.glob("*.encode_s"))
        for i in range(args.repeats):
            runs["raw"].append(bench_raw(n, data, Path(tmp) / f"r{i}", k))
            runs["store"].append(bench_store(n, data, Path(tmp) / f"s{i}", "decode", k))
            runs["store_header"].append(bench_store(n, data, Path(tmp) / f"h{i}", "header", k))
    result = summarize(tokens, runs, encode_s) | {"clients": k, "smoke": args.smoke}
    print_table(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def summarize(tokens: int, runs: dict[str, list[dict[str, float]]],
              encode_s: float) -> dict[str, object]:
    rates = {side: [tokens / (r["write_s"] + r["drain_s"]) for r in rs]
             for side, rs in runs.items()}
    best = {side: statistics.median(rs) for side, rs in rates.items()}
    top = {side: max(rs) for side, rs in rates.items()}
    mem = {side: rs[-1]["mem_bytes"] / tokens for side, rs in runs.items()}
    store_cpu = min(r["store_process_cpu_s"] for r in runs["store"])
    cpu = {side: min(r["total_cpu_s"] for r in rs) / tokens for side, rs in runs.items()}
    return {
        "tokens": tokens, "clients": CLIENTS, "group_size": GROUP, "repeats": len(rates["raw"]),
        "shape": {"prompt": PROMPT, "response": RESPONSE, "layers": LAYERS, "topk": TOPK,
                  "num_experts": EXPERTS, "generator": "skewed"},
        "store_tokens_per_s": best["store"], "raw_tokens_per_s": best["raw"],
        "throughput_ratio": best["store"] / best["raw"],
        "statistic": "median of the interleaved runs",
        "best_run_throughput_ratio": top["store"] / top["raw"],
        "store_tokens_per_s_runs": rates["store"], "raw_tokens_per_s_runs": rates["raw"],
        # Same store with routing_validation="header" (no payload decode): not the default.
        "store_header_tokens_per_s": best["store_header"],
        "store_header_tokens_per_s_runs": rates["store_header"],
        "store_header_throughput_ratio": best["store_header"] / best["raw"],
        "store_header_bytes_per_token": mem["store_header"],
        "store_header_total_cpu_us_per_token": 1e6 * cpu["store_header"],
        "store_bytes_per_token": mem["store"], "raw_bytes_per_token": mem["raw"],
        "bytes_per_token_ratio": mem["store"] / mem["raw"],
        "store_process_cpu_us_per_token": 1e6 * store_cpu / tokens,
        # All processes of a side (clients, drain, store, redis): CPU-s per token does not
        # depend on what else the shared machine runs; raw/store estimates the throughput
        # ratio on an otherwise idle machine whose cores are all busy.
        "store_total_cpu_us_per_token": 1e6 * cpu["store"],
        "raw_total_cpu_us_per_token": 1e6 * cpu["raw"],
        "cpu_cost_ratio_raw_over_store": cpu["raw"] / cpu["store"],
        "encode_cpu_us_per_token": 1e6 * encode_s / tokens,
        # Per process kind, least of the runs: where each side's CPU goes.
        "cpu_us_per_token_by_process": {
            side: {k.removesuffix("_cpu_s"): 1e6 * min(r[k] for r in rs) / tokens
                   for k in rs[0] if k.endswith("_cpu_s") and k != "total_cpu_s"}
            for side, rs in runs.items()},
        "runs": runs, "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}


def print_table(r: dict) -> None:  # noqa: ANN001
    print(f"{'side':<13}{'median tok/s':>15}{'all runs (tokens/s)':>72}{'bytes/token':>13}")
    for side in ("raw", "store", "store_header"):
        runs = ", ".join(f"{x:,.0f}" for x in r[side + "_tokens_per_s_runs"])
        print(f"{side:<13}{r[side + '_tokens_per_s']:>15,.0f}{runs:>72}"
              f"{r[side + '_bytes_per_token']:>13,.1f}")
    print(f"store_header = routing_validation='header' (not the default): ratio "
          f"{r['store_header_throughput_ratio']:.3f}")
    print(f"throughput_ratio {r['throughput_ratio']:.3f} (medians; target >= 0.5; best runs "
          f"{r['best_run_throughput_ratio']:.3f})   "
          f"bytes_per_token_ratio {r['bytes_per_token_ratio']:.3f} (target <= 0.5)   "
          f"tokens {r['tokens']:,}")
    print(f"CPU us/token, all processes: raw {r['raw_total_cpu_us_per_token']:.2f}, store "
          f"{r['store_total_cpu_us_per_token']:.2f} (raw/store "
          f"{r['cpu_cost_ratio_raw_over_store']:.3f}), store_header "
          f"{r['store_header_total_cpu_us_per_token']:.2f}")
    for side, parts in r["cpu_us_per_token_by_process"].items():
        print(f"  {side} CPU us/token by process: "
              + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    print(f"store process CPU {r['store_process_cpu_us_per_token']:.2f} us/token; routing encode "
          f"(worker side, off the clock) {r['encode_cpu_us_per_token']:.2f} us/token; "
          f"load average {r['load_avg_1m']:.1f} on {r['cpu_count']} CPUs")


if __name__ == "__main__":
    main()
