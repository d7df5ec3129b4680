"""Experiment tracking: each step's numeric metrics to TensorBoard (event files in the run
folder, on by default), and optionally to W&B and MLflow.

TensorBoard files are written without the tensorboard package (trainer.loop.tb_events);
`tensorboard --logdir <run_dir>/tensorboard` shows them. W&B and MLflow are used when their
package is installed (neither is in r3flow's locks): a run that asks for one without it fails
at start naming the package. Nested metrics (agreement by layer, quarantines by reason) are
logged as `key/sub`; strings and booleans are left out.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field

from services.common.config import StrictConfig
from trainer.loop.tb_events import EventWriter

TB_DIR = "tensorboard"  # under the run folder


class TrackingConfig(StrictConfig):
    """Where step metrics go besides train_log.jsonl and Prometheus."""

    tensorboard: bool = Field(True, description="event files under <run_dir>/tensorboard")
    wandb: bool = Field(False, description="log to Weights & Biases (needs the wandb package)")
    wandb_project: str = Field("r3flow", description="W&B project")
    wandb_mode: Literal["online", "offline"] = Field(
        "offline", description="offline writes <run_dir>/wandb only (`wandb sync` uploads it); "
        "online needs network and WANDB_API_KEY")
    mlflow: bool = Field(False, description="log to MLflow (needs the mlflow package)")
    mlflow_uri: str = Field(
        "", description="MLflow tracking URI; empty = file:<run_dir>/mlruns (no server)")
    experiment: str = Field("r3flow", description="MLflow experiment name")


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def close(self) -> None: ...


def scalars_of(metrics: dict) -> dict[str, float]:
    """The finite numbers of a step's metrics, nested dicts as `key/sub`."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out |= {f"{k}/{kk}": vv for kk, vv in scalars_of(v).items()}
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


def _need(package: str, field: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError:
        raise ValueError(f"tracking.{field}: needs the `{package}` package, which is not "
                         f"installed (pip install {package})") from None


class TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        self.writer = EventWriter(run_dir / TB_DIR)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.writer.scalars(step, scalars)

    def close(self) -> None:
        pass  # nothing held open between steps


class Wandb:
    def __init__(self, cfg: TrackingConfig, run_dir: Path) -> None:
        self.wandb = wandb = _need("wandb", "wandb")
        self.run = wandb.init(project=cfg.wandb_project, name=run_dir.name, dir=str(run_dir),
                              mode=cfg.wandb_mode)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        # finish() can return before wandb's service process has written the run file (an
        # offline run read right after held only its header, under load): teardown waits for it
        self.wandb.teardown()


class Mlflow:
    def __init__(self, cfg: TrackingConfig, run_dir: Path) -> None:
        self.mlflow = _need("mlflow", "mlflow")
        uri = cfg.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store (no database server, no SQLAlchemy) behind this
            # documented opt-out; a database or server URI in tracking.mlflow_uri needs none
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.mlflow.set_tracking_uri(uri)
        self.mlflow.set_experiment(cfg.experiment)
        self.run = self.mlflow.start_run(run_name=run_dir.name)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # MLflow metric names allow [\w./ -]: `:` etc. of a reason label become `_`
        self.mlflow.log_metrics({_mlflow_key(k): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _mlflow_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def open_trackers(cfg: TrackingConfig, run_dir: Path) -> list[Tracker]:
    """The trackers `cfg` asks for (ValueError naming the field when a package is missing)."""
    out: list[Tracker] = []
    if cfg.wandb:
        out.append(Wandb(cfg, run_dir))
    if cfg.mlflow:
        out.append(Mlflow(cfg, run_dir))
    if cfg.tensorboard:
        out.append(TensorBoard(run_dir))
    return out
