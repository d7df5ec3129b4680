"""Routing replay, shared by both backends: the replay modes, the replay controller protocol
and how a forward drives it (`drive`), the agreement counters and their floor check (and errors).

The backends hold the router-specific halves: trainer.megatron.replay (megatron's native
RouterReplay, router forward hooks) and trainer.hf.routers (HF router forward hooks).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

import torch


class ReplayMode(StrEnum):
    R3 = "r3"  # replay the rollout engine's routing
    R2 = "r2"  # record in the old-policy logprob pass, replay in the update passes
    OFF = "off"


class RoutingAgreementError(ValueError):
    """Replayed routing disagrees with the trainer's router below the configured floor.

    `bad_groups`: GRPO group id -> what was wrong in it (the groups to quarantine)."""

    def __init__(self, message: str, bad_groups: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.bad_groups = bad_groups or {}


class ReplayDesyncError(RuntimeError):
    """A router used experts other than the ids replayed to it: replay bypassed or out of step
    (a system fault, never a data fault: it is raised, not quarantined)."""


class ReplayController(Protocol):
    """Drives one model's routers (trainer.megatron.replay.ModelReplay, hf.routers.HFModelReplay)."""

    def replay_forward(self, rows_per_layer: list[torch.Tensor]) -> None: ...
    def after_forward(self) -> None: ...
    def record(self) -> None: ...
    def recorded(self) -> list[torch.Tensor]: ...
    def natural(self) -> None: ...
    def end_step(self) -> None: ...


def drive(ctl: ReplayController, rows: list[torch.Tensor] | None, record: bool) -> None:
    """Replay `rows`, else record (R2 old-policy pass), else route naturally."""
    if rows is not None:
        ctl.replay_forward(rows)
    elif record:
        ctl.record()
    else:
        ctl.natural()


class AgreementStats:
    """Agreement counters per layer and per trajectory unit, the used-equals-replayed flag and
    the floor check; the backends' monitors feed them from their router hooks."""

    desync: str | None  # the first used-vs-replayed mismatch since reset()

    def __init__(self, hf_layers: Sequence[int], top_k: int) -> None:
        self.hf_layers, self.top_k = tuple(hf_layers), top_k
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        n = len(self.hf_layers)
        self.agree, self.total = [0] * n, [0] * n
        self.units: dict[tuple[str, str, str], list[int]] = {}  # (group, traj, unit) -> [a, t]
        self.desync = None

    def collect(self, mb) -> None:
        """File the hits of `mb`'s forward (backends that count per unit override it)."""

    def per_layer(self) -> dict[int, float]:
        """MoE layer index -> agreement ratio (layers that saw no replayed tokens are left out)."""
        return {m: a / t for m, (a, t) in enumerate(zip(self.agree, self.total, strict=True))
                if t}

    def overall(self) -> float | None:
        total = sum(self.total)
        return sum(self.agree) / total if total else None

    def worst(self) -> tuple[str, float] | None:
        """('trajectory T unit U (group G)', ratio) of the unit with the lowest agreement."""
        scored = {k: a / t for k, (a, t) in self.units.items() if t}
        if not scored:
            return None
        g, tid, unit = min(scored, key=lambda k: scored[k])
        return f"trajectory {tid} {unit} (group {g})", scored[(g, tid, unit)]

    def check_used(self) -> None:
        """Raise ReplayDesyncError if any replaying forward used other experts than replayed."""
        if self.desync is not None:
            raise ReplayDesyncError(self.desync)

    def check(self, floor: float) -> None:
        """Raise RoutingAgreementError naming the worst unit (and layer) below `floor`; its
        `bad_groups` are every group with a unit below the floor."""
        self.check_used()
        layers = self.per_layer()
        bad_units = {k: a / t for k, (a, t) in self.units.items() if t and a / t < floor}
        bad_layers = {m: r for m, r in layers.items() if r < floor}
        if not bad_units and not bad_layers:
            return
        m = min(layers, key=lambda layer: layers[layer])
        where = f"MoE layer {m} (HF layer {self.hf_layers[m]}) reads {layers[m]:.3f}"
        if bad_units:
            (g, tid, unit) = min(bad_units, key=lambda k: bad_units[k])
            head = (f"routing agreement {bad_units[(g, tid, unit)]:.3f} < floor {floor} at "
                    f"trajectory {tid} {unit} (group {g}); {len(bad_units)} units below floor; "
                    f"worst {where}")
        else:
            head = f"routing agreement below floor {floor}: {where}"
        groups: dict[str, str] = {}
        for (g, tid, unit), r in sorted(bad_units.items(), key=lambda kv: kv[1]):
            groups.setdefault(g, f"routing agreement {r:.3f} < floor {floor} at trajectory "
                                 f"{tid} {unit}")
        raise RoutingAgreementError(
            f"{head} - misaligned layer map, row offset or bad ids?", groups)
