"""Faults of one training step, decided on every trainer rank together: a fault one group's
data caused ends in that group's quarantine, anything else is raised on every rank at once.

A pass (the old-policy pass, each optimizer update) runs through `run_pass`. What it raises is
mapped to a `Fault` (`blame`): routing agreement below the floor or a replay desync in some
micro-batches names their groups; an out-of-memory error names the group of the longest
trajectory of the micro-batch in flight; anything else is fatal. A non-finite update is found
by the backend itself, at its vote point before the optimizer step (`checkpoint`: a non-finite
loss or gradient anywhere skips the step on every rank); the groups whose loss is non-finite
are the ones `nonfinite_groups` names. A sample whose rollout logprobs are not all finite is
refused before any pass (`nonfinite_logprob_groups`): the store refuses them at append, so one
here came around it (a store of an older version, a test's sample), and with `old_logprobs:
trainer` it would train fine but turn every |rollout - trainer| metric into NaN. Every rank then takes part in the same collectives, in
the same order:
  1. `vote`: an all-reduce (MAX) of each rank's `Level`; a rank whose pass went through votes
     OK at the end of the pass or at a backend vote point (before the grad reduction, before
     the optimizer step), so a peer's fault is heard there instead of stranding it;
  2. if anyone voted, `gather`: every rank's fault, all-gathered; every rank drops the union of
     their groups (the pass is then redone without them), a fatal one is raised on every rank.
A fault raised inside a collective (an OOM in the middle of an EP all-to-all, a TP all-reduce,
a pipeline send or an FSDP all-gather) strands its peers in it until the collective times
out: docs/replay_guarantees.md says which layouts that leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist

from trainer.ranks.collectives import max_over_ranks
from trainer.replay import ReplayDesyncError, RoutingAgreementError
from trainer.samples.batch import MicroBatch, Sample, sample_spans

log = logging.getLogger(__name__)
T = TypeVar("T")


class Level(IntEnum):
    """What a rank votes (the worst vote wins)."""

    OK = 0
    DATA = 1  # groups to quarantine (or a non-finite update, skipped on every rank)
    FATAL = 2  # a fault no group's data explains: raised on every rank


@dataclass
class Fault:
    """Groups to quarantine (group id -> reason) and/or a fatal error message."""

    groups: dict[str, str] = field(default_factory=dict)
    fatal: str | None = None

    @property
    def level(self) -> Level:
        return Level.FATAL if self.fatal else Level.DATA


class PeerFault(RuntimeError):
    """A backend vote point heard a fault (a non-finite update here, or any rank's fault):
    the step was not applied; `run_pass` gathers the groups next."""


class RankFailed(RuntimeError):
    """Another rank's pass failed with a fault no group explains (raised on every rank)."""


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def vote(level: int) -> int:
    """The worst `level` of all trainer ranks (an all-reduce MAX over the world group)."""
    return max_over_ranks(int(level))


def checkpoint(level: int) -> None:
    """A backend's vote point (every rank calls it at the same place): PeerFault if any rank
    votes a fault."""
    got = vote(level)
    if got:
        raise PeerFault(f"a trainer rank voted {Level(got).name}: update not applied")


VOTED = "r3flow_voted_fault"  # attribute of an error whose fault `vote_on` already voted


def vote_on(fn: Callable[[], T], in_flight: MicroBatch | None = None) -> T:
    """fn's result, after a vote point every rank reaches: a rank whose `fn` raised votes its
    fault there and re-raises the error (marked VOTED: `run_pass` does not vote it again); its
    peers hear it (PeerFault) instead of going on into a collective the failed rank never
    joins (a backend's per-pass work before its first collective: the replay ids' checks
    before the dispatch plan's gather)."""
    try:
        out = fn()
    except Exception as err:
        fault = blame(err, in_flight)
        vote(fault.level)
        setattr(err, VOTED, fault)
        raise
    checkpoint(Level.OK)
    return out


def gather(fault: Fault) -> Fault:
    """Every rank's fault, merged: the union of the groups, the first fatal message."""
    if _world() == 1:
        return fault
    parts: list = [None] * _world()
    dist.all_gather_object(parts, (fault.groups, fault.fatal))
    groups = {g: why for p in parts for g, why in p[0].items()}
    fatal = next((f"rank {r}: {p[1]}" for r, p in enumerate(parts) if p[1]), None)
    return Fault(groups, fatal)


def _longest_group(mb: MicroBatch | None) -> dict[str, str]:
    if mb is None or not mb.samples:
        return {}
    s = max(mb.samples, key=lambda x: x.tokens.size)
    return {s.group_id: f"out of memory on trajectory {s.trajectory_id} ({s.tokens.size} tokens)"}


def blame(err: Exception, in_flight: MicroBatch | None) -> Fault:
    """The groups `err` is the fault of, or a fatal fault when no group's data explains it."""
    if isinstance(err, RoutingAgreementError | ReplayDesyncError) and err.bad_groups:
        reason = "routing_agreement" if isinstance(err, RoutingAgreementError) else "replay_desync"
        for g, why in err.bad_groups.items():
            log.error("group %s (%s): %s", g, reason, why)
        return Fault({g: reason for g in err.bad_groups})
    if isinstance(err, torch.OutOfMemoryError):
        groups = _longest_group(in_flight)
        for g, why in groups.items():
            log.error("group %s (oom): %s", g, why)
        if groups:
            return Fault({g: "oom" for g in groups})
    return Fault(fatal=f"{type(err).__name__}: {err}")


def run_pass(fn: Callable[[], T], in_flight: Callable[[], MicroBatch | None],
             blamed: dict[str, str] | None = None) -> tuple[T | None, Fault | None]:
    """(fn's result, None), or (None, the fault every rank agreed on); a fatal fault is raised
    on every rank (the original error where it happened). `blamed`: groups this rank already
    knows are at fault when a backend vote point raises PeerFault (non-finite loss)."""
    try:
        out = fn()
    except PeerFault:
        return None, _settle(Fault(dict(blamed or {})), None)
    except Exception as err:  # every exception: a rank that leaves silently strands its peers
        fault = getattr(err, VOTED, None)
        if fault is None:  # not voted yet (vote_on votes where it raised)
            fault = blame(err, in_flight())
            vote(fault.level)
        return None, _settle(fault, err)
    if vote(Level.OK):
        return None, _settle(Fault(), None)
    return out, None


def _settle(fault: Fault, err: Exception | None) -> Fault:
    union = gather(fault)
    if union.fatal:
        if err is not None and fault.fatal:
            raise err
        raise RankFailed(union.fatal)
    return union


def nonfinite_groups(mb: MicroBatch, span_loss: Callable[[int, slice], torch.Tensor]
                     ) -> dict[str, str]:
    """Groups of `mb` whose loss is non-finite: `span_loss(row, positions)` is the per-token loss
    of one sample's positions (every loss term is per token, so a span's loss is its own)."""
    bad: dict[str, str] = {}
    for s, b, o in sample_spans(mb):
        loss = span_loss(b, slice(o, o + s.tokens.size))
        finite = torch.isfinite(loss)
        if not bool(finite.all()):
            log.error("group %s (non_finite): %d non-finite loss term(s) on trajectory %s",
                      s.group_id, int((~finite).sum()), s.trajectory_id)
            bad[s.group_id] = "non_finite"
    return bad


NONFINITE_LOGPROBS = "non_finite_logprobs"  # quarantine reason: refused before the step


def nonfinite_logprob_groups(samples: Sequence[Sample]) -> dict[str, str]:
    """Groups with a sample whose rollout logprobs are not all finite (NaN or infinite), each
    logged with the trajectory and the first response positions."""
    bad: dict[str, str] = {}
    for s in samples:
        where = np.flatnonzero(~np.isfinite(s.rollout_logprobs))
        if where.size:
            log.error("group %s (%s): trajectory %s has %d non-finite rollout logprob(s), at "
                      "response token(s) %s", s.group_id, NONFINITE_LOGPROBS, s.trajectory_id,
                      where.size, where[:5].tolist())
            bad[s.group_id] = NONFINITE_LOGPROBS
    return bad
