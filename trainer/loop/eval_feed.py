"""The rollout workers' held-out eval results (services.rollout.evaluation, their `eval.log`
JSONL) into the trainer's step log and trackers: each step's record gets the rows written since
the previous step as `eval/<source>/accuracy`, `eval/<source>/pass@<k>` and
`eval/<source>/policy_version` (the version the score ran on, which lags the step's)."""

from __future__ import annotations

import json
from pathlib import Path


class EvalFeed:
    """Reads the complete rows appended to the eval log since the last read."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.offset = 0

    def new_metrics(self) -> dict[str, float]:
        """The rows since the last call, flattened (a later row of a source wins)."""
        if self.path is None or not self.path.exists():
            return {}
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a row being written waits for the next step
        self.offset += len(complete)
        out: dict[str, float] = {}
        for line in complete.decode().splitlines():
            if line.strip():
                out |= flat(json.loads(line))
        return out


def flat(row: dict) -> dict[str, float]:
    """One eval row as step-log keys."""
    key = f"eval/{row['source']}"
    out = {f"{key}/policy_version": row["policy_version"]}
    if row.get("accuracy") is not None:
        out[f"{key}/accuracy"] = row["accuracy"]
    out |= {f"{key}/pass@{k}": v for k, v in row.get("pass_at_k", {}).items()}
    return out
