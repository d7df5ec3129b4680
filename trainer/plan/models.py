"""Model configs the planner knows by name, so specs can be planned where the weights are not
(CI, a laptop): the HF config.json keys the estimate reads, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from services.common import families
from services.common.errors import UserError, syntax_error


def _known() -> dict:
    """Known model name -> its HF config builder: the `planner_models` of every registered
    family (services.common.families)."""
    return {name: build for f in families.all_families()
            for name, build in f.planner_models.items()}


def known_names() -> list[str]:
    return list(_known())


def load_model_config(source: str) -> dict:
    """`source`: a known name, an HF model directory or a config.json path."""
    known = _known()
    if source in known:
        return dict(known[source]())
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"model config: {source!r} is neither a known name "
                         f"({', '.join(known_names())}) nor a config.json / model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise syntax_error(path, e) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"model config {path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise UserError(f"model config {path}: not a JSON object")
    return data
