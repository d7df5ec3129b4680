"""What a rollout worker reports: its run's counts (`WorkerSummary`, written as JSON beside
the run), repeated errors logged once and then counted (`RepeatedLog`)."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RepeatedLog:
    """Logs an error message the first time, then only a count of its repeats (a message is
    the same when it differs only in numbers: group ids, prompt ids, epochs), at repeat
    1, 10, 100, ... and in `flush`."""

    def __init__(self, logger: logging.Logger) -> None:
        self.log = logger
        self.counts: dict[str, int] = {}

    def error(self, msg: str) -> None:
        key = re.sub(r"\d+", "N", msg)
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        if n == 1:
            self.log.error("%s", msg)
        elif n in (2, 11, 101, 1001, 10001) or n % 100000 == 1:
            self.log.error("%s (seen %d times)", msg, n)

    def flush(self) -> None:
        for key, n in self.counts.items():
            if n > 1:
                self.log.error("%d errors like: %s", n, key)
        self.counts.clear()


@dataclass
class WorkerSummary:
    """Counts of one `run`; tokens are generated tokens (environment tokens excluded); `errors`
    holds the first failure messages (worker.MAX_KEPT_ERRORS). Every started group ends as exactly one
    of ok (sent), failed (counted by reason in metrics) or abandoned (cut by a stop request)."""

    groups_started: int = 0
    groups_ok: int = 0
    groups_failed: int = 0
    groups_abandoned: int = 0
    trajectories_sent: int = 0
    trajectories_failed: int = 0
    trajectories_abandoned: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    stopped_early: bool = False
    errors: list[str] = field(default_factory=list)
    fatal: str | None = None  # why the worker stopped on its own (its engine died, ...)
    eval: list[dict] = field(default_factory=list)  # the eval rows (services.rollout.evaluation)

    @property
    def groups_in_flight(self) -> int:
        return self.groups_started - self.groups_ok - self.groups_failed - self.groups_abandoned


def write_json_atomic(path: str, data: Any) -> None:
    """`data` as JSON at `path` (a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, target)
