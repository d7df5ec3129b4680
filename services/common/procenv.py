"""Environment of the Python processes r3flow starts itself (trainer ranks, Ray workers, the
scripts tests and benches run): they extend the parent's PYTHONPATH, never replace it.

A runner may put packages on PYTHONPATH (scripts/gpu_run.sh installs megatron-core into
/tmp/pylib that way): a child given `PYTHONPATH=<repo>` alone lost them and failed with
ModuleNotFoundError on the GPU machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def pythonpath(*first: str | Path, env: Mapping[str, str] | None = None) -> str:
    """PYTHONPATH for a child: `first` (this checkout ...), then every entry the parent's
    PYTHONPATH (`env`, default os.environ) already has, in order; empty and repeated entries
    dropped."""
    parent = (os.environ if env is None else env).get("PYTHONPATH", "")
    entries = [str(p) for p in first] + parent.split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))
