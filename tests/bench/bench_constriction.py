"""Routing codec A/B against `constriction` (issue 20): our rANS coder (services/common/routing.py,
C core) against constriction 0.5.0's range coder with the same adaptive model, in one run.

Data (tests/bench/routing_data.py, seeded, as `make bench-codec`): `skewed` and `uniform`,
16,384 tokens x 48 layers x top-8 of 128 experts, and the 511-token blob the store checks per
trajectory (512 tokens, rows = tokens - 1), canonical mode (rows as sets, the default).

The constriction side codes what ours codes, with the statistics ours uses (routing_core/model.c):
per layer, a "repeats the previous token's row" flag per row (adaptive Bernoulli), and for each
fresh row its K gaps in the layer's expert-popularity order, one adaptive categorical per gap
position; popularity order and tables are rebuilt from the counts so far at ours' rows (8, 24,
72, ..., 5832, then every 4,096), identically on both sides. Between rebuilds the model is
fixed, so each block's symbols go to constriction in one vectorised call per position
(`queue.RangeEncoder` + `model.Categorical(perfect=False)`: FIFO, so an adaptive model needs no
reversal; its leaky quantisation keeps unseen symbols codable). It has no near-uniform fallback
(ours codes a layer at the information floor when the adaptive model would cost more).

Sizes: bytes per (token, layer) row, ours = the whole blob (32-byte header, 32 bytes of rANS
states), constriction = its compressed words only. Speeds: best thread-CPU time of --repeats
calls, rounds alternating between the coders; `check` = ours walking a blob without building ids
(routing.check), constriction has no such walk (its check is a decode). MB/s of uint8 input.
Usage: .venv/bin/python tests/bench/bench_constriction.py [--repeats 5] [--out FILE]
(needs constriction: requirements/bench.lock, installed by `make setup`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: the repository's packages

import constriction  # noqa: E402

from services.common import routing  # noqa: E402
from tests.bench.routing_data import skewed_routing, uniform_routing  # noqa: E402

EXPERTS, TOPK = 128, 8
FIRST_REBUILD, REBUILD_STEP = 8, 4096
INIT_COUNT = 0.25  # pseudo-count of every symbol before any is seen


def _blocks(tokens: int) -> list[tuple[int, int]]:
    """[start, end) row ranges between model rebuilds, ours (routing_core/model.c
    rebuild_after): rows 8, 24, 72, ..., 5832 (x3), then every 4,096."""
    out, start, end = [], 0, FIRST_REBUILD
    while start < tokens:
        out.append((start, min(end, tokens)))
        start, end = end, 3 * end if end < REBUILD_STEP else end + REBUILD_STEP
    return out


class _LayerModel:
    """The adaptive model of one layer, identical in encoder and decoder."""

    def __init__(self, num_experts: int, topk: int) -> None:
        self.flags = np.array([1.0, 1.0])  # counts of (fresh, repeat)
        self.popularity = np.zeros(num_experts)
        self.gaps = np.full((topk, num_experts), INIT_COUNT)
        self.order = np.arange(num_experts)  # rank -> expert
        self.rank_of = np.arange(num_experts)  # expert -> rank
        self.flag_model = self.gap_models = None
        self.rebuild()

    def rebuild(self) -> None:
        self.order = np.argsort(-self.popularity, kind="stable")
        self.rank_of = np.empty_like(self.order)
        self.rank_of[self.order] = np.arange(self.order.size)
        cat = constriction.stream.model.Categorical
        self.flag_model = cat(self.flags / self.flags.sum(), perfect=False)
        self.gap_models = [cat(g / g.sum(), perfect=False) for g in self.gaps]

    def update(self, flags: np.ndarray, fresh_ids: np.ndarray, gaps: np.ndarray) -> None:
        self.flags += np.bincount(flags, minlength=2)
        self.popularity += np.bincount(fresh_ids.ravel(), minlength=self.popularity.size)
        for j in range(gaps.shape[1]):
            self.gaps[j] += np.bincount(gaps[:, j], minlength=self.gaps.shape[1])
        self.rebuild()


def constriction_encode(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """Canonical rows of ids_TLK -> constriction's compressed words (uint32)."""
    tokens, layers, topk = ids_TLK.shape
    rows_TLK = np.sort(ids_TLK, axis=-1).astype(np.int64)
    enc = constriction.stream.queue.RangeEncoder()
    blocks = _blocks(tokens)
    for layer in range(layers):
        rows = rows_TLK[:, layer]
        repeat = np.zeros(tokens, np.int32)
        repeat[1:] = (rows[1:] == rows[:-1]).all(-1)
        model = _LayerModel(num_experts, topk)
        for a, b in blocks:
            flags = repeat[a:b] if a else repeat[1:b]  # row 0 is always fresh
            enc.encode(flags, model.flag_model)
            fresh = rows[a:b][repeat[a:b] == 0]
            ranks = np.sort(model.rank_of[fresh], axis=-1)
            gaps = np.diff(ranks, axis=-1, prepend=-1).astype(np.int32) - 1
            for j in range(topk):
                enc.encode(np.ascontiguousarray(gaps[:, j]), model.gap_models[j])
            model.update(flags, fresh, gaps)
    return enc.get_compressed()


def constriction_decode(words: np.ndarray, shape: tuple[int, int, int],
                        num_experts: int) -> np.ndarray:
    tokens, layers, topk = shape
    dec = constriction.stream.queue.RangeDecoder(words)
    out_TLK = np.empty(shape, np.uint8 if num_experts <= 256 else np.uint16)
    blocks = _blocks(tokens)
    for layer in range(layers):
        model = _LayerModel(num_experts, topk)
        repeat = np.zeros(tokens, bool)
        rows = np.empty((tokens, topk), np.int64)
        for a, b in blocks:
            n = b - a if a else b - 1
            flags = dec.decode(model.flag_model, n) if n else np.zeros(0, np.int32)
            repeat[max(a, 1):b] = flags.astype(bool)
            n_fresh = int((~repeat[a:b]).sum())
            gaps = np.stack([dec.decode(model.gap_models[j], n_fresh) for j in range(topk)], -1) \
                if n_fresh else np.zeros((0, topk), np.int32)
            ranks = np.cumsum(gaps + 1, axis=-1) - 1
            fresh = np.sort(model.order[ranks], axis=-1)
            rows[a:b][~repeat[a:b]] = fresh
            model.update(flags.astype(np.int64), fresh, gaps)
        last_fresh = np.maximum.accumulate(np.where(repeat, 0, np.arange(tokens)))
        out_TLK[:, layer] = rows[last_fresh]
    return out_TLK


def best_cpu(fn, repeats: int) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeats):
        c0 = time.thread_time()
        result = fn()
        best = min(best, time.thread_time() - c0)
    return best, result


def ab(ids_TLK: np.ndarray, repeats: int) -> dict:
    """Sizes and per-call CPU times of both coders on one input, rounds interleaved."""
    tokens, layers, topk = ids_TLK.shape
    rows, mb = tokens * layers, ids_TLK.size / 1e6
    want = np.sort(ids_TLK, axis=-1)
    times: dict[str, float] = {}
    blob = routing.encode(ids_TLK, EXPERTS)
    words = constriction_encode(ids_TLK, EXPERTS)
    if not np.array_equal(routing.decode(blob), want):
        raise SystemExit("ours: round trip failed")
    if not np.array_equal(constriction_decode(words, ids_TLK.shape, EXPERTS), want):
        raise SystemExit("constriction: round trip failed")
    # constriction's coder alone: as many symbols as the model codes (flags + fresh rows' gaps),
    # one fixed categorical, one call each way: a lower bound on any model built around it.
    rows_TLK = np.sort(ids_TLK, axis=-1)
    n_fresh = int(layers + (rows_TLK[1:] != rows_TLK[:-1]).any(-1).sum())
    symbols = np.random.default_rng(0).integers(0, EXPERTS, layers * (tokens - 1)
                                                + n_fresh * topk).astype(np.int32)
    flat = constriction.stream.model.Categorical(np.full(EXPERTS, 1 / EXPERTS), perfect=False)

    def kernel_encode() -> np.ndarray:
        enc = constriction.stream.queue.RangeEncoder()
        enc.encode(symbols, flat)
        return enc.get_compressed()

    kernel_words = kernel_encode()
    calls = {
        "constriction_kernel_encode": kernel_encode,
        "constriction_kernel_decode": lambda: constriction.stream.queue.RangeDecoder(
            kernel_words).decode(flat, symbols.size),
        "ours_encode": lambda: routing.encode(ids_TLK, EXPERTS),
        "ours_decode": lambda: routing.decode(blob),
        "ours_check": lambda: routing.check(blob),
        "constriction_encode": lambda: constriction_encode(ids_TLK, EXPERTS),
        "constriction_decode": lambda: constriction_decode(words, ids_TLK.shape, EXPERTS),
    }
    for _ in range(repeats):  # one call of each per round: drift hits both coders alike
        for name, fn in calls.items():
            t, _ = best_cpu(fn, 1)
            times[name] = min(times.get(name, math.inf), t)
    floor = routing.floor_bits_per_row(EXPERTS, topk) / 8
    ours_b, con_b = len(blob), words.size * 4
    r = {"rows": rows, "floor_bytes_per_row": floor,
         "ours_bytes": ours_b, "constriction_bytes": con_b,
         "ours_bytes_per_row": ours_b / rows, "constriction_bytes_per_row": con_b / rows,
         "size_ratio_constriction_over_ours": con_b / ours_b}
    for name, t in times.items():
        r[f"{name}_ms"] = t * 1e3
        r[f"{name}_mb_s"] = mb / t
    for op in ("encode", "decode"):
        r[f"{op}_time_ratio_constriction_over_ours"] = \
            times[f"constriction_{op}"] / times[f"ours_{op}"]
        r[f"{op}_time_ratio_constriction_kernel_over_ours"] = \
            times[f"constriction_kernel_{op}"] / times[f"ours_{op}"]
    r["check_time_ratio_constriction_decode_over_ours_check"] = \
        times["constriction_decode"] / times["ours_check"]
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--out", default=str(REPO / "bench-results/constriction.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="make test's run: 512 tokens, one repeat (the keys, not the figures)")
    a = ap.parse_args()
    if a.smoke:
        a.tokens, a.repeats = 512, 1
    cases = {
        f"skewed_{a.tokens}": skewed_routing(a.tokens),
        f"uniform_{a.tokens}": uniform_routing(a.tokens),
        "skewed_511": skewed_routing(511),
        "uniform_511": uniform_routing(511),
    }
    results = {}
    for name, ids in cases.items():
        results[name] = ab(ids, a.repeats)
        r = results[name]
        print(f"{name:<15} bytes/row ours {r['ours_bytes_per_row']:.3f} constriction "
              f"{r['constriction_bytes_per_row']:.3f} (x{r['size_ratio_constriction_over_ours']:.3f}"
              f", floor {r['floor_bytes_per_row']:.3f}) | encode ms ours "
              f"{r['ours_encode_ms']:.2f} constriction {r['constriction_encode_ms']:.2f} "
              f"(x{r['encode_time_ratio_constriction_over_ours']:.1f}) | decode ms ours "
              f"{r['ours_decode_ms']:.2f} constriction {r['constriction_decode_ms']:.2f} "
              f"(x{r['decode_time_ratio_constriction_over_ours']:.1f}) | check ms ours "
              f"{r['ours_check_ms']:.2f} | constriction coder alone: encode "
              f"x{r['encode_time_ratio_constriction_kernel_over_ours']:.2f}, decode "
              f"x{r['decode_time_ratio_constriction_kernel_over_ours']:.2f} of ours", flush=True)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load_1min_at_end": os.getloadavg()[0],
            "constriction": "0.5.0", "repeats": a.repeats, "tokens": a.tokens,
            "smoke": a.smoke}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
