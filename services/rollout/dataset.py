"""Prompt datasets: JSONL or Parquet rows -> `PromptRecord`s, and prompts -> tokens.

A row has a prompt (text, a messages list, or `prompt_token_ids`), a ground truth `answer`,
and optionally an `id`, a per-row `verifier`, a `data_source` and extra fields. Which column
holds what is a mapping (`prompts.columns` preset, `prompts.column_map` overrides); the verl
preset reads verl's parquet layout unchanged. A bad row is skipped with one line naming the
file, the row and the column; only a file with no good row stops the worker.

`PromptRenderer` turns a record into prompt token ids: messages through the tokenizer's own
chat template (system prompt, generation prompt, template kwargs), text as it is.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.rollout.config import PromptConfig

log = logging.getLogger(__name__)

FIELDS = ("id", "prompt", "prompt_token_ids", "answer", "verifier", "data_source")
# r3flow field -> source column (dotted: a member of a struct column).
PRESETS: dict[str, dict[str, str]] = {
    "r3flow": {f: f for f in FIELDS},
    "verl": {"id": "extra_info.index", "prompt": "prompt",
             "answer": "reward_model.ground_truth", "data_source": "data_source"},
}
# Columns a preset keeps as the row's extra fields; None: every column not mapped.
EXTRA_COLUMNS: dict[str, frozenset[str] | None] = {"r3flow": frozenset({"extra_info"}),
                                                   "verl": None}
MAX_LOGGED_ROWS = 20  # bad rows named one by one; the rest are counted in one line


@dataclass(frozen=True)
class PromptRecord:
    """One dataset row; exactly one of `prompt` / `messages` / `prompt_token_ids` is set."""

    prompt_id: str
    answer: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    verifier: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    data_source: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def token_ids(self, encode: Callable[[str], list[int]]) -> list[int]:
        """Prompt token ids of a text or token prompt, tokenizing the text with `encode`."""
        if self.prompt_token_ids is not None:
            return list(self.prompt_token_ids)
        if self.prompt is None:
            raise ValueError(f"prompt {self.prompt_id}: a messages prompt needs the chat "
                             "template (PromptRenderer)")
        return list(encode(self.prompt))


@dataclass(frozen=True)
class ColumnMap:
    """Where each field of a row is read from, and which other columns are kept as extras."""

    fields: Mapping[str, str]
    extra: frozenset[str] | None

    @classmethod
    def from_config(cls, cfg: PromptConfig) -> ColumnMap:
        unknown = set(cfg.column_map) - set(FIELDS)
        if unknown:
            raise ValueError(f"prompts.column_map: unknown field(s) {sorted(unknown)} "
                             f"(known: {list(FIELDS)})")
        return cls({**PRESETS[cfg.columns], **cfg.column_map}, EXTRA_COLUMNS[cfg.columns])

    def read(self, row: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(field -> value of the fields present, extras); ValueError names a refused column."""
        values = {}
        for name, path in self.fields.items():
            value = _lookup(row, path)
            if value is not None:
                values[name] = value
        mapped = set(self.fields.values())
        rest = {k: v for k, v in row.items() if k not in mapped}
        if self.extra is None:
            return values, rest
        unknown = set(rest) - self.extra
        if unknown:
            raise ValueError(f"column {sorted(unknown)[0]!r}: unknown (known: "
                             f"{sorted(mapped | self.extra)}; prompts.columns: verl keeps "
                             "every column)")
        return values, rest


def _lookup(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _messages(value: Any, column: str) -> tuple[dict[str, Any], ...]:
    if not value or not all(isinstance(m, Mapping) for m in value):
        raise ValueError(f"column {column!r}: expected text or a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        msg = {k: v for k, v in m.items() if v is not None}
        if not isinstance(msg.get("role"), str):
            raise ValueError(f"column {column!r}: message {i}: `role` must be a string")
        if not isinstance(msg.get("content", ""), str):
            raise ValueError(f"column {column!r}: message {i}: `content` must be text")
        out.append(msg)
    return tuple(out)


def _token_ids(value: Any, column: str) -> tuple[int, ...]:
    ids = list(value) if isinstance(value, list | tuple) else None
    if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                              for t in ids):
        raise ValueError(f"column {column!r}: expected a list of non-negative ints")
    return tuple(ids)


def _prompt(values: Mapping[str, Any], cols: Mapping[str, str], cfg: PromptConfig
            ) -> dict[str, Any]:
    text, ids = values.get("prompt"), values.get("prompt_token_ids")
    if (text is None) == (ids is None):
        raise ValueError(f"column {cols['prompt']!r}: exactly one of `prompt` and "
                         "`prompt_token_ids` is required")
    if ids is not None:
        return {"prompt_token_ids": _token_ids(ids, cols["prompt_token_ids"])}
    if isinstance(text, str):
        return {"prompt": text}
    if cfg.chat_template == "never":
        raise ValueError(f"column {cols['prompt']!r}: a messages prompt, and "
                         "prompts.chat_template is never")
    if not isinstance(text, list | tuple):
        raise ValueError(f"column {cols['prompt']!r}: expected text or a list of messages, "
                         f"got {type(text).__name__}")
    return {"messages": _messages(text, cols["prompt"])}


def record_from_row(row: Mapping[str, Any], where: str, index: int = 0,
                    cfg: PromptConfig | None = None) -> PromptRecord:
    """Validate one row (the `index`-th); ValueError names `where` and the column."""
    cfg = cfg or PromptConfig()
    columns = ColumnMap.from_config(cfg)
    try:
        return _record(row, index, cfg, columns)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _record(row: Mapping[str, Any], index: int, cfg: PromptConfig, columns: ColumnMap
            ) -> PromptRecord:
    values, extra = columns.read(row)
    cols = columns.fields
    if values.get("answer") is None:
        raise ValueError(f"column {cols['answer']!r}: answer missing")
    for name in ("verifier", "data_source"):
        if name in values and not isinstance(values[name], str):
            raise ValueError(f"column {cols[name]!r}: expected a string")
    return PromptRecord(
        prompt_id=str(values["id"]) if values.get("id") is not None else str(index),
        answer=str(values["answer"]), verifier=values.get("verifier"),
        data_source=values.get("data_source"), extra=extra,
        **_prompt(values, cols, cfg))


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, row) per line; a line that is no JSON object comes as (where, its error)."""
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", f"invalid JSON: {e}"
                continue
            yield f"{path}:{lineno}", row if isinstance(row, dict) else "expected a JSON object"


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path} row {i}", {k: v for k, v in row.items() if v is not None}


def _rows(p: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    if not p.is_file():
        raise ValueError(f"dataset: file not found: {p}")
    if p.suffix in (".jsonl", ".json"):
        return _jsonl_rows(p)
    if p.suffix == ".parquet":
        return _parquet_rows(p)
    raise ValueError(f"dataset: unsupported format {p.suffix!r} (use .jsonl or .parquet)")


def load_dataset(path: str | Path, cfg: PromptConfig | None = None,
                 on_bad_row: Callable[[str], None] | None = None) -> list[PromptRecord]:
    """The good rows of a `.jsonl`/`.json` or `.parquet` file. Each bad row is skipped and
    reported as one line to `on_bad_row` (default: a warning, the first MAX_LOGGED_ROWS named,
    then one count); ValueError when no row is good."""
    p, cfg = Path(path), cfg or PromptConfig()
    columns = ColumnMap.from_config(cfg)
    report = on_bad_row or _BadRowLog().warn
    records, skipped = [], 0
    for i, (where, row) in enumerate(_rows(p)):
        try:
            if isinstance(row, str):
                raise ValueError(row)
            records.append(_record(row, i, cfg, columns))
        except ValueError as e:
            skipped += 1
            report(f"{where}: skipped: {e}")
    if skipped:
        log.warning("dataset %s: %d good rows, %d bad rows skipped", p, len(records), skipped)
    if not records:
        raise ValueError(f"dataset: {p} holds no good rows ({skipped} bad)")
    return records


class _BadRowLog:
    """Names the first MAX_LOGGED_ROWS bad rows (the load's summary line counts them all)."""

    def __init__(self) -> None:
        self.count = 0

    def warn(self, line: str) -> None:
        self.count += 1
        if self.count <= MAX_LOGGED_ROWS:
            log.warning("%s", line)


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


# What a new message renders to is the template's text of (BASE + new) past the text of BASE:
# the same base for every turn, so the tokens do not depend on earlier turns' wording.
_BASE_CHAT = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"})


@dataclass(frozen=True)
class RenderedPrompt:
    """A record's prompt as the engine gets it (ids) and as a reward sees it (text);
    `messages` is the conversation for a messages prompt (system prompt included)."""

    token_ids: list[int]
    text: str
    messages: tuple[dict[str, Any], ...] | None = None


class PromptRenderer:
    """Records -> prompt tokens with the model's tokenizer (one per worker)."""

    def __init__(self, tokenizer: Any, cfg: PromptConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg

    def render(self, rec: PromptRecord) -> RenderedPrompt:
        """Token ids and text of `rec`'s prompt; ValueError names the prompt on a template
        failure (that group fails alone)."""
        if rec.prompt_token_ids is not None:
            ids = list(rec.prompt_token_ids)
            return RenderedPrompt(ids, self.tokenizer.decode(ids))
        messages = self.conversation(rec)
        if messages is None:
            assert rec.prompt is not None
            return RenderedPrompt(list(self.tokenizer.encode(rec.prompt)), rec.prompt)
        try:
            text = self.template(messages, self.cfg.add_generation_prompt)
        except Exception as e:  # jinja errors of the model's own template (bad roles, ...)
            raise ValueError(f"prompt {rec.prompt_id}: chat template failed: "
                             f"{type(e).__name__}: {e}") from None
        return RenderedPrompt(self.encode(text), text, messages)

    def conversation(self, rec: PromptRecord) -> tuple[dict[str, Any], ...] | None:
        """The messages of `rec` with the system prompt first, or None for a raw text prompt."""
        messages = rec.messages
        if messages is None and self.cfg.chat_template == "always" and rec.prompt is not None:
            messages = ({"role": "user", "content": rec.prompt},)
        if messages is None:
            return None
        if self.cfg.system_prompt is not None and messages[0].get("role") != "system":
            messages = ({"role": "system", "content": self.cfg.system_prompt}, *messages)
        return messages

    def template(self, messages: Any, add_generation_prompt: bool) -> str:
        """The tokenizer's chat template applied to `messages` (text, not yet tokens)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template (set one in the model's "
                             "tokenizer_config.json, or use text prompts)")
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.cfg.chat_template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Tokens of rendered text; the template wrote any BOS itself."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def message_ids(self, new: list[dict[str, Any]]) -> list[int]:
        """Tokens that append `new` messages (tool results, a user reply) to a conversation
        whose last turn the model ended, up to the next assistant header."""
        base = self.template(_BASE_CHAT, False)
        full = self.template([*_BASE_CHAT, *new], True)
        if not full.startswith(base):
            raise ValueError("chat template: rendering more messages changed the earlier "
                             "text; environment messages cannot be appended as tokens")
        return self.encode(full[len(base):])
