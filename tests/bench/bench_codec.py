"""Routing codec benchmark (`make bench-codec`): size and speed against zstd in the same run.

Data sets (tests/bench/routing_data.py, seeded): `uniform` and `skewed`, 16,384 tokens x 48
layers x top-8 of 128 experts (Qwen3-30B-A3B-shaped). Baselines: the raw uint8 array and
zstd levels 3 and 19 of its bytes. Speeds are MB/s of uint8-equivalent input
(tokens*layers*topk bytes), best of --repeats runs, timed by the calling thread's CPU clock
(one core; on this shared 2-core machine wall time also counts other processes' slices, so
it is reported alongside). Writes bench-results/codec.json; exits 1 if a target is missed.
`--baseline-rev REV` adds a same-run A/B of the C core against routing_core.c at git REV
(sizes and check/decode/encode time per blob, 511- and 16,384-token inputs; the cores are
called through ctypes, so the baseline may write another format version); on a machine without
the repository's history, `--baseline-archive FILE` takes the output of
`git archive REV services/common` instead. Legend: T = tokens, L = layers, K = top-k.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

from services.common import _build, routing  # noqa: E402
from tests.bench.routing_data import skewed_routing, uniform_routing  # noqa: E402

TOKENS, LAYERS, TOPK, EXPERTS = 16_384, 48, 8, 128
SEGMENT = 512
TARGET_MB_S = 200.0
TARGET_RATIO = {"uniform": 1.03, "skewed": 0.80}  # bytes per row / floor


def best_time(fn, repeats: int) -> tuple[float, float, object]:
    """(best thread-CPU seconds, best wall seconds, last result) over `repeats` calls."""
    cpu = wall = math.inf
    result = None
    for _ in range(repeats):
        c0, w0 = time.thread_time(), time.perf_counter()
        result = fn()
        cpu = min(cpu, time.thread_time() - c0)
        wall = min(wall, time.perf_counter() - w0)
    return cpu, wall, result


def measure(ids_TLK: np.ndarray, mode: str, repeats: int) -> dict:
    rows, mb = ids_TLK.shape[0] * ids_TLK.shape[1], ids_TLK.size / 1e6
    enc_cpu, enc_wall, blob = best_time(lambda: routing.encode(ids_TLK, EXPERTS, mode), repeats)
    dec_cpu, dec_wall, out_TLK = best_time(lambda: routing.decode(blob), repeats)
    want_TLK = np.sort(ids_TLK, axis=-1) if mode == "canonical" else ids_TLK
    if not np.array_equal(out_TLK, want_TLK):
        raise SystemExit(f"round trip failed ({mode})")
    floor_bits = routing.floor_bits_per_row(EXPERTS, TOPK)
    if mode == "exact":
        floor_bits += math.log2(math.factorial(TOPK))
    return {
        "bytes_per_row": len(blob) / rows,
        "floor_bytes_per_row": floor_bits / 8,
        "ratio_to_floor": len(blob) / rows / (floor_bits / 8),
        "ratio_to_uint8": len(blob) / ids_TLK.size,
        "encode_mb_s": mb / enc_cpu,
        "decode_mb_s": mb / dec_cpu,
        "encode_mb_s_wall": mb / enc_wall,
        "decode_mb_s_wall": mb / dec_wall,
    }


def zstd_ratios(ids_TLK: np.ndarray) -> dict:
    raw = ids_TLK.tobytes()
    return {
        f"zstd{level}_ratio_to_uint8": len(zstandard.ZstdCompressor(level=level).compress(raw))
        / len(raw)
        for level in (3, 19)
    }


def targets(name: str, r: dict) -> dict:
    return {
        f"ratio_to_floor<={TARGET_RATIO[name]}": r["ratio_to_floor"] <= TARGET_RATIO[name],
        "smaller_than_zstd19": r["ratio_to_uint8"] < r["zstd19_ratio_to_uint8"],
        f"encode_mb_s>={TARGET_MB_S:.0f}": r["encode_mb_s"] >= TARGET_MB_S,
        f"decode_mb_s>={TARGET_MB_S:.0f}": r["decode_mb_s"] >= TARGET_MB_S,
    }


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def print_table(results: dict) -> None:
    cols = [
        "bytes_per_row",
        "ratio_to_floor",
        "ratio_to_uint8",
        "zstd3_ratio_to_uint8",
        "zstd19_ratio_to_uint8",
        "encode_mb_s",
        "decode_mb_s",
    ]
    print(f"{'data set':<20}" + "".join(f"{c:>23}" for c in cols))
    for name, r in results.items():
        print(f"{name:<20}" + "".join(f"{r[c]:>23.3f}" if c in r else f"{'-':>23}" for c in cols))


# ----------------------------------------------------------------------------- A/B
# This checkout's C core against one built from routing_core.c at a git revision, both called
# through ctypes. Rounds alternate between the cores so both see the same machine load; each
# figure is the best round's thread CPU time per call.

CORE_SOURCE = "services/common/routing_core.c"
# (name, generator, tokens, mode, calls per round): a 511-token blob is what the store checks
# per trajectory (512 tokens, rows = tokens - 1); 16,384 tokens is the codec bench's shape.
AB_CASES = [
    ("skewed_511", skewed_routing, 511, "canonical", 60),
    ("skewed_511_exact", skewed_routing, 511, "exact", 30),
    ("uniform_511", uniform_routing, 511, "canonical", 30),
    ("skewed_16384", skewed_routing, 16_384, "canonical", 2),
    ("uniform_16384", uniform_routing, 16_384, "canonical", 2),
]


class Core:
    """Encode/check/decode through one build of the C core."""

    def __init__(self, path: Path):
        self.lib = routing._load_library(path)

    def encode(self, ids_TLK: np.ndarray, mode: str) -> bytes:
        out = ctypes.c_void_p()
        tokens, layers, topk = ids_TLK.shape
        n = self.lib.r3_encode(ids_TLK.ctypes.data, ids_TLK.itemsize, tokens, layers, topk,
                               EXPERTS, routing.MODES.index(mode), ctypes.byref(out), None)
        if n < 0:
            raise RuntimeError(f"r3_encode failed ({n})")
        try:
            return ctypes.string_at(out, n)
        finally:
            self.lib.r3_free(out)

    def check(self, data: np.ndarray, info: np.ndarray) -> None:
        rc = self.lib.r3_check(data.ctypes.data, len(data), info.ctypes.data)
        if rc:
            raise RuntimeError(f"r3_check refused a valid blob ({rc}, {info[0]})")

    def decode(self, data: np.ndarray, out_TLK: np.ndarray, info: np.ndarray) -> None:
        rc = self.lib.r3_decode(data.ctypes.data, len(data), out_TLK.ctypes.data,
                                out_TLK.itemsize, info.ctypes.data)
        if rc:
            raise RuntimeError(f"r3_decode refused a valid blob ({rc}, {info[0]})")


def build_core(rev: str, workdir: Path, archive_file: Path | None = None) -> Path:
    """Compile routing_core.c as of git revision `rev` (or from `archive_file`, a tar of
    `git archive REV services/common`) with the build's own flags."""
    # The whole folder: since issue 20 routing_core.c includes its sections from routing_core/.
    if archive_file is not None:
        archive = archive_file.read_bytes()
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "services/common"],
                                 capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
    source = workdir / CORE_SOURCE
    library = workdir / "_routing_core_baseline.so"
    subprocess.run(_build.compile_command(source, library), capture_output=True, check=True)
    return library


def per_call(fn: Callable[[], None], calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls


def case_ops(core: Core, ids_TLK: np.ndarray, mode: str) -> tuple[int, dict]:
    """Blob size and the three timed operations of one core on one input."""
    blob = core.encode(ids_TLK, mode)
    data, info = np.frombuffer(blob, np.uint8), np.zeros(4, np.int64)
    out_TLK = np.empty_like(ids_TLK)
    core.decode(data, out_TLK, info)
    want_TLK = np.sort(ids_TLK, axis=-1) if mode == "canonical" else ids_TLK
    if not np.array_equal(out_TLK, want_TLK):
        raise SystemExit("A/B: round trip failed")
    return len(blob), {
        "encode": lambda: core.encode(ids_TLK, mode),
        "check": lambda: core.check(data, info),
        "decode": lambda: core.decode(data, out_TLK, info),
    }


def run_case(cores: dict[str, Core], ids_TLK: np.ndarray, mode: str, calls: int,
             rounds: int) -> dict:
    sizes, ops, best = {}, {}, {}
    for name, core in cores.items():
        sizes[name], ops[name] = case_ops(core, ids_TLK, mode)
        best[name] = dict.fromkeys(ops[name], math.inf)
    for _ in range(rounds):  # interleaved: every round times both cores
        for name in cores:
            for op, fn in ops[name].items():
                best[name][op] = min(best[name][op], per_call(fn, calls))
    row = {f"bytes_{name}": sizes[name] for name in cores}
    row["bytes_ratio"] = sizes["new"] / sizes["baseline"]
    for op in ("check", "decode", "encode"):
        for name in cores:
            row[f"{op}_us_{name}"] = best[name][op] * 1e6
        row[f"{op}_speedup"] = best["baseline"][op] / best["new"][op]
    return row


def ab_against(rev: str, rounds: int, archive_file: Path | None = None) -> dict:
    """{case: sizes, per-call microseconds of both cores, speedups} for every case."""
    with tempfile.TemporaryDirectory() as tmp:
        cores = {"baseline": Core(build_core(rev, Path(tmp), archive_file)),
                 "new": Core(_build.ensure_built())}
        results = {}
        for name, make, tokens, mode, calls in AB_CASES:
            ids_TLK = make(tokens, LAYERS, TOPK, EXPERTS, seed=1)
            results[name] = run_case(cores, ids_TLK, mode, calls, rounds)
    return results


def print_ab(rev: str, results: dict) -> None:
    cols = ["bytes_baseline", "bytes_new", "bytes_ratio", "check_us_baseline", "check_us_new",
            "check_speedup", "decode_us_baseline", "decode_us_new", "decode_speedup",
            "encode_us_baseline", "encode_us_new", "encode_speedup"]
    print(f"\nC core A/B against {rev} (same run, interleaved rounds, best per-call CPU time)")
    print(f"{'case':<18}" + "".join(f"{c:>20}" for c in cols))
    for name, row in results.items():
        print(f"{name:<18}" + "".join(f"{row[c]:>20.3f}" for c in cols))


def measure_dataset(name: str, make: Callable, tokens: int, repeats: int) -> dict:
    """The targeted figures of one data set, and two informational rows: exact mode (keeps the
    engine's top-k order) and a 512-token segment, the size the store handles per prompt
    (fixed costs show there)."""
    ids_TLK = make(tokens, LAYERS, TOPK, EXPERTS, seed=0)
    r = measure(ids_TLK, "canonical", repeats) | zstd_ratios(ids_TLK)
    r["targets_met"] = targets(name, r)
    segment_TLK = make(SEGMENT, LAYERS, TOPK, EXPERTS, seed=1)
    return {name: r, f"{name}_exact": measure(ids_TLK, "exact", max(2, repeats // 2)),
            f"{name}_{SEGMENT}_tokens": measure(segment_TLK, "canonical", 5 * repeats)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--smoke", action="store_true",
                    help="make test's run: 512 tokens, one repeat, targets not judged")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "codec.json")
    ap.add_argument("--baseline-rev", help="git revision whose routing_core.c is the A/B baseline")
    ap.add_argument("--baseline-archive", type=Path,
                    help="tar of `git archive REV services/common`: the A/B baseline without git")
    args = ap.parse_args()
    if args.baseline_archive and not args.baseline_rev:
        args.baseline_rev = args.baseline_archive.name
    tokens = 512 if args.smoke else TOKENS
    if args.smoke:
        args.repeats = 1
    datasets = {"uniform": uniform_routing, "skewed": skewed_routing}
    results, ok = {}, True
    for name, make in datasets.items():
        results |= measure_dataset(name, make, tokens, args.repeats)
        ok &= all(results[name]["targets_met"].values())
    print_table(results)
    # Top level: one entry per targeted data set, as other tools read it; the rest aside.
    report = {name: results[name] for name in datasets}
    report["informational"] = {k: v for k, v in results.items() if k not in datasets}
    report["meta"] = {
        "shape": {"tokens": tokens, "layers": LAYERS, "topk": TOPK, "num_experts": EXPERTS},
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "timing": "thread CPU time, best of repeats, one core",
        "all_targets_met": ok,
        "smoke": args.smoke,  # tiny sizes: the targets are not judged (exit 0)
    }
    if args.baseline_rev:
        report["ab"] = {"baseline_rev": args.baseline_rev,
                        "cases": ab_against(args.baseline_rev, args.repeats,
                                            args.baseline_archive)}
        print_ab(args.baseline_rev, report["ab"]["cases"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        missed = [k for k, v in r.get("targets_met", {}).items() if not v]
        if missed:
            print(f"{name}: missed {', '.join(missed)}")
    out = args.out.resolve()
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
