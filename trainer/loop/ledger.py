"""`trained_ids.jsonl`: the trajectory ids each trained step took, across restarts.

Every trained step appends its ids before the checkpoint that covers it is written; a resumed
trainer appends a `resumed_at` line, and steps after it were rolled back by the crash, so
"trained on exactly once" can be checked from the trainer's side (`read_trained_ids`). Each
step also names where its groups' prompts came from, `[worker_id, epoch, prompt_id]` a group
(`read_trained_prompts`): which prompts a fleet of rollout pods trained on, per pod and epoch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO


class TrainedIdsLedger:
    """Appends step and resume records to one `trained_ids.jsonl`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def step(self, step: int, policy_version: int, trajectory_ids: list[str],
             prompts: Sequence[tuple[str, int, str]] = ()) -> None:
        """`prompts`: (worker_id, epoch, prompt_id) of each group of the step."""
        self._append({"step": step, "policy_version": policy_version,
                      "trajectory_ids": trajectory_ids, "prompts": [list(p) for p in prompts]})

    def resumed(self, step: int) -> None:
        self._append({"resumed_at": step})

    def _append(self, rec: dict) -> None:
        # Flushed before the checkpoint that covers the step, so a crash can only leave a line
        # too many (rolled back by the next `resumed_at`), never one too few.
        with self.path.open("a+b") as f:
            f.write((b"\n" if _torn(f) else b"") + json.dumps(rec).encode() + b"\n")


def _torn(f: IO[bytes]) -> bool:
    """True when a file open for append does not end in a newline (a kill mid-write)."""
    if f.seek(0, 2) == 0:
        return False
    f.seek(-1, 2)
    return f.read(1) != b"\n"


def read_trained_ids(path: str | Path) -> dict[int, list[str]]:
    """Step -> trajectory ids of the steps that survived every restart (a `resumed_at: k` line
    discards the steps after k that the crashed trainer took but never checkpointed)."""
    return {s: list(rec["trajectory_ids"]) for s, rec in _surviving(path).items()}


def read_trained_prompts(path: str | Path) -> dict[int, list[tuple[str, int, str]]]:
    """Step -> (worker_id, epoch, prompt_id) of each group, for the surviving steps (a ledger
    written before the prompts were recorded reads as no prompts)."""
    return {s: [(str(w), int(e), str(p)) for w, e, p in rec.get("prompts", [])]
            for s, rec in _surviving(path).items()}


def _surviving(path: str | Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # torn by a kill mid-write: a step that was never checkpointed
        if "resumed_at" in rec:
            steps = {s: r for s, r in steps.items() if s <= rec["resumed_at"]}
        else:
            steps[int(rec["step"])] = rec
    return steps
