"""Prompt datasets: JSONL or Parquet rows with `prompt` (text) or `prompt_token_ids`, `answer`,
and optional `id` and `verifier` (a per-row override of the configured verifier).

Rows are validated one by one; a bad row is reported with its line/row number.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_KNOWN = {"id", "prompt", "prompt_token_ids", "answer", "verifier"}


@dataclass(frozen=True)
class PromptRecord:
    """One dataset row; exactly one of `prompt` / `prompt_token_ids` is set."""

    prompt_id: str
    answer: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    verifier: str | None = None

    def token_ids(self, encode: Callable[[str], list[int]]) -> list[int]:
        """Prompt token ids, tokenizing the text with `encode` when needed."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        assert self.prompt is not None
        return list(encode(self.prompt))


def record_from_row(row: dict[str, Any], where: str, index: int = 0) -> PromptRecord:
    """Validate one row (a dict, the `index`-th); ValueError names `where` and the field."""
    unknown = set(row) - _KNOWN
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)} (known: {sorted(_KNOWN)})")
    text, ids = row.get("prompt"), row.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise ValueError(f"{where}: exactly one of `prompt` and `prompt_token_ids` is required")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: prompt: expected a string, got {type(text).__name__}")
    if ids is not None:
        ids = list(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"{where}: prompt_token_ids: expected a list of non-negative ints")
    if "answer" not in row or row["answer"] is None:
        raise ValueError(f"{where}: answer: missing")
    verifier = row.get("verifier")
    if verifier is not None and not isinstance(verifier, str):
        raise ValueError(f"{where}: verifier: expected a string")
    return PromptRecord(
        prompt_id=str(row["id"]) if row.get("id") is not None else str(index),
        answer=str(row["answer"]), prompt=text,
        prompt_token_ids=tuple(ids) if ids is not None else None, verifier=verifier)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            yield f"{path}:{lineno}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path} row {i}", {k: v for k, v in row.items() if v is not None}


def load_dataset(path: str | Path) -> list[PromptRecord]:
    """All rows of a `.jsonl`/`.json` or `.parquet` file, validated."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"dataset: file not found: {p}")
    if p.suffix in (".jsonl", ".json"):
        rows = _jsonl_rows(p)
    elif p.suffix == ".parquet":
        rows = _parquet_rows(p)
    else:
        raise ValueError(f"dataset: unsupported format {p.suffix!r} (use .jsonl or .parquet)")
    records = [record_from_row(row, where, i) for i, (where, row) in enumerate(rows)]
    if not records:
        raise ValueError(f"dataset: {p} holds no rows")
    return records


def shard_order(n: int, epoch: int, shard: int, num_shards: int, shuffle: bool,
                seed: int) -> list[int]:
    """Row indices shard `shard` of `num_shards` takes in `epoch`: one permutation of all rows
    per epoch (file order, or a shuffle seeded by (seed, epoch), the same on every worker),
    dealt round-robin. The shards of one epoch are disjoint and cover every row once."""
    order = list(range(n))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order[shard::num_shards]


def iterate_prompts(records: list[PromptRecord], epochs: int, num_prompts: int | None, *,
                    shard: int = 0, num_shards: int = 1, shuffle: bool = False,
                    seed: int = 0) -> Iterator[tuple[int, PromptRecord]]:
    """(epoch, record) pairs of this worker's shard: `epochs` passes (0 = without end, a new
    shuffle each epoch), at most `num_prompts` in all."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not one of num_shards {num_shards}")
    if num_shards > len(records):
        raise ValueError(f"dataset: {len(records)} prompts cannot feed {num_shards} shards")
    count = 0
    for epoch in itertools.count() if epochs == 0 else range(epochs):
        for i in shard_order(len(records), epoch, shard, num_shards, shuffle, seed):
            if num_prompts is not None and count >= num_prompts:
                return
            count += 1
            yield epoch, records[i]
