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

from trainer.samples.batch import sample_spans


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
    """A router used experts other than the ids replayed to it: replay bypassed or out of step.

    `bad_groups`: the groups of the micro-batches whose forward desynchronised, when only some
    did (quarantined); empty when every micro-batch of the pass did or a backward recompute
    did (a system fault: raised on every rank together)."""

    def __init__(self, message: str, bad_groups: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.bad_groups = bad_groups or {}


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


# (group id, trajectory id, unit name, HF layer): agreement is judged per such cell
UnitKey = tuple[str, str, str, int]


class AgreementStats:
    """Agreement counters per MoE layer and per (trajectory unit x MoE layer), the
    used-equals-replayed flag and the floor check; the backends' monitors feed them from their
    router hooks. A unit is a trajectory's prompt rows or one segment's rows
    (Sample.agreement_units); judging each unit on each layer separately keeps one bad layer of
    one segment from being averaged away by the other layers or the rest of the batch."""

    desync: str | None  # the first used-vs-replayed mismatch since reset()

    def __init__(self, hf_layers: Sequence[int], top_k: int) -> None:
        self.hf_layers, self.top_k = tuple(hf_layers), top_k
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        n = len(self.hf_layers)
        self.agree, self.total = [0] * n, [0] * n
        self.units: dict[UnitKey, list[int]] = {}  # -> [agreeing ids, replayed ids]
        self.desync = None
        self.desync_groups: dict[str, str] = {}  # groups of the micro-batches that desynced
        self.mbs_seen = self.mbs_desynced = 0  # micro-batches with samples since reset()
        self.unattributed = False  # a desync no one micro-batch owns (a backward recompute)

    def collect(self, mb) -> None:
        """File the hits of `mb`'s forward (backends that count per unit override it)."""

    def _flush(self) -> None:
        """Move hits still held on the device into the counters (HF monitor)."""

    def note_forward(self, mb, desynced: bool) -> None:
        """Count a forward of `mb` for the desync verdict (filler micro-batches are left out)."""
        if not mb.samples:
            return
        self.mbs_seen += 1
        if desynced:
            self.mbs_desynced += 1
            for s in mb.samples:
                self.desync_groups.setdefault(
                    s.group_id, f"replay desync in the micro-batch of trajectory {s.trajectory_id}")

    def file_units(self, mb, hits_LBS: torch.Tensor, mine_S: torch.Tensor) -> None:
        """Add `mb`'s per-row hits [L, B, S] to its units' cells, per MoE layer; `mine_S` marks
        the sequence positions this rank routes (SP shard). Unit sums are differences of prefix
        sums, taken on the hits' device and copied to the host once."""
        units = [(smp, name, b, o + a, o + e) for smp, b, o in sample_spans(mb)
                 for name, a, e in smp.agreement_units()]
        if not units:
            return
        dev, n_layers = hits_LBS.device, hits_LBS.shape[0]
        prefix_LBS = torch.nn.functional.pad(hits_LBS.long().cumsum(2), (1, 0))
        mine_S1 = torch.nn.functional.pad(mine_S.long().to(dev).cumsum(0), (1, 0))
        b_U, a_U, e_U = (torch.tensor([u[i] for u in units], device=dev) for i in (2, 3, 4))
        flat = torch.cat([(prefix_LBS[:, b_U, e_U] - prefix_LBS[:, b_U, a_U]).t().flatten(),
                          mine_S1[e_U] - mine_S1[a_U]]).tolist()
        rows_U = flat[len(units) * n_layers:]
        for j, (smp, name, *_) in enumerate(units):
            if not rows_U[j]:
                continue
            for m, h in enumerate(self.hf_layers):
                cell = self.units.setdefault((smp.group_id, smp.trajectory_id, name, h), [0, 0])
                cell[0] += int(flat[j * n_layers + m])
                cell[1] += int(rows_U[j]) * self.top_k

    def per_layer(self) -> dict[int, float]:
        """The model's layer number (HF layer, dense layers counted) -> agreement ratio, the
        numbering the messages and the engines use (layers with no replayed token left out)."""
        self._flush()
        return {h: a / t for h, a, t in zip(self.hf_layers, self.agree, self.total, strict=True)
                if t}

    def overall(self) -> float | None:
        self._flush()
        total = sum(self.total)
        return sum(self.agree) / total if total else None

    def where(self, key: UnitKey) -> str:
        """'trajectory T U (group G) MoE layer m (HF layer h)' of a unit cell."""
        g, tid, unit, h = key
        m = self.hf_layers.index(h) if h in self.hf_layers else -1
        return f"trajectory {tid} {unit} (group {g}) MoE layer {m} (HF layer {h})"

    def worst(self) -> tuple[UnitKey, float] | None:
        """(cell, ratio) of the (unit, MoE layer) cell with the lowest agreement; `where(cell)`
        reads it, cell[3] is its model layer number."""
        self._flush()
        scored = {k: a / t for k, (a, t) in self.units.items() if t}
        if not scored:
            return None
        key = min(scored, key=lambda k: scored[k])
        return key, scored[key]

    def check_used(self) -> None:
        """Raise ReplayDesyncError if any replaying forward used other experts than replayed;
        it names the groups to quarantine unless every micro-batch desynced (a system fault)."""
        if self.desync is None:
            return
        partial = not self.unattributed and 0 < self.mbs_desynced < self.mbs_seen
        raise ReplayDesyncError(self.desync, self.desync_groups if partial else None)

    def check(self, floor: float, min_ids: int = 1) -> None:
        """Raise RoutingAgreementError naming the worst (trajectory unit, MoE layer) cell below
        `floor`; its `bad_groups` are every group with a cell below the floor. A cell of fewer
        than `min_ids` replayed ids is too small to judge alone (a 3-token prompt at top-2 reads
        0.333 on one differing tie): such a unit is judged on its cells pooled over the MoE
        layers (a shifted 3-token segment reads low on every layer, a tie on one), and every
        cell counts in its layer's batch agreement."""
        self.check_used()
        layers = self.per_layer()
        bad = {k: a / t for k, (a, t) in self.units.items() if t >= min_ids and a / t < floor}
        pooled: dict[tuple[str, str, str], list[int]] = {}
        for (g, tid, unit, _h), (a, t) in self.units.items():
            if t < min_ids:
                cell = pooled.setdefault((g, tid, unit), [0, 0])
                cell[0], cell[1] = cell[0] + a, cell[1] + t
        for (g, tid, unit), (a, t) in pooled.items():
            if t >= min_ids and a / t < floor:  # the unit's worst small cell names it
                cell_key, ratio = min(
                    ((k, ka / kt) for k, (ka, kt) in self.units.items()
                     if k[:3] == (g, tid, unit) and 0 < kt < min_ids), key=lambda kv: kv[1])
                bad[cell_key] = ratio
        bad_layers = {h: r for h, r in layers.items() if r < floor}
        if not bad and not bad_layers:
            return
        h = min(layers, key=lambda layer: layers[layer], default=None)
        where = "" if h is None else \
            f"MoE layer {self.hf_layers.index(h)} (HF layer {h}) reads {layers[h]:.3f}"
        if bad:
            key = min(bad, key=lambda k: bad[k])
            head = (f"routing agreement {bad[key]:.3f} < floor {floor:.3f} at {self.where(key)}; "
                    f"{len(bad)} (unit, layer) cells below floor; over the batch {where}")
        else:
            head = f"routing agreement below floor {floor:.3f}: {where}"
        groups: dict[str, str] = {}
        for key, r in sorted(bad.items(), key=lambda kv: kv[1]):
            groups.setdefault(key[0], f"routing agreement {r:.3f} < floor {floor:.3f} at "
                                      f"{self.where(key)}")
        raise RoutingAgreementError(
            f"{head} - misaligned layer map, row offset or bad ids?", groups)
