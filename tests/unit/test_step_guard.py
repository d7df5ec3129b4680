"""trainer.guard and the per-(unit, MoE layer) agreement counters, without a model (1 rank).

tests/integration/test_trainer_guard.py runs them in both backends' steps and
test_trainer_guard_ranks.py on 2 gloo ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.guard import Fault, PeerFault, RankFailed, blame, nonfinite_groups, run_pass
from trainer.hf.packing import pack_microbatch
from trainer.replay import AgreementStats, ReplayDesyncError, RoutingAgreementError
from trainer.samples.batch import Sample, make_microbatch, sample_spans

K, LAYERS = 2, tuple(range(1, 8))


def sample(i: int, group: str, n: int = 10, prompt: int = 4) -> Sample:
    r = n - prompt
    return Sample(np.arange(n, dtype=np.int64) + 4, prompt, np.full(r, -1.0, np.float32),
                  np.ones(r, bool), 0.0, group, trajectory_id=f"t{i}")


def file_hits(stats: AgreementStats, mb, bad: tuple[int, int] | None = None) -> None:
    """All replayed ids agree, except on MoE layer bad[1] of sample bad[0] (none agree)."""
    b, s = mb.tokens_BS.shape
    hits_LBS = torch.full((len(stats.hf_layers), b, s), K, dtype=torch.long)
    for i, (smp, row, o) in enumerate(sample_spans(mb)):
        if bad is not None and bad[0] == i:
            hits_LBS[bad[1], row, o:o + smp.tokens.size] = 0
    stats.file_units(mb, hits_LBS, torch.ones(s, dtype=torch.bool))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("layers", [LAYERS, tuple(range(1, 49))])
def test_one_bad_layer_of_one_trajectory_is_its_own_cell(packed, layers):
    """Averaged over 48 layers the bad one would read 47/48: judged per cell it reads 0."""
    samples = [sample(0, "a"), sample(1, "a"), sample(2, "b", n=14)]
    mb = pack_microbatch(samples) if packed else make_microbatch(samples)
    stats = AgreementStats(layers, K)
    file_hits(stats, mb, bad=(2, 5))
    with pytest.raises(RoutingAgreementError, match=r"at trajectory t2 prompt \(group b\) "
                                                    r"MoE layer 5 \(HF layer 6\)") as err:
        stats.check(0.5)
    assert set(err.value.bad_groups) == {"b"}
    healthy = AgreementStats(layers, K)
    file_hits(healthy, mb)
    healthy.check(0.99)


def test_desync_in_some_microbatches_names_their_groups_in_all_is_a_system_fault():
    mbs = [make_microbatch([sample(0, "a")]), make_microbatch([sample(1, "b")])]
    stats = AgreementStats(LAYERS, K)
    stats.desync = "MoE layer 0: the router used other experts"
    stats.note_forward(mbs[0], desynced=True)
    stats.note_forward(mbs[1], desynced=False)
    with pytest.raises(ReplayDesyncError) as err:
        stats.check_used()
    assert set(err.value.bad_groups) == {"a"}
    assert blame(err.value, None).groups == {"a": "replay_desync"}
    stats.reset()
    stats.desync = "MoE layer 0: the router used other experts"
    for mb in mbs:
        stats.note_forward(mb, desynced=True)
    with pytest.raises(ReplayDesyncError) as err:
        stats.check_used()
    assert not err.value.bad_groups and blame(err.value, None).fatal


def test_oom_blames_the_longest_trajectory_of_the_microbatch_in_flight():
    mb = make_microbatch([sample(0, "short"), sample(1, "long", n=30)])
    assert blame(torch.OutOfMemoryError("CUDA out of memory"), mb).groups == {"long": "oom"}
    assert blame(torch.OutOfMemoryError("CUDA out of memory"), None).fatal


def test_nonfinite_groups_are_found_span_by_span_in_packed_rows():
    samples = [sample(0, "a"), sample(1, "b"), sample(2, "c")]
    mb = pack_microbatch(samples)
    values = torch.zeros(mb.tokens_BS.shape)
    o = samples[0].tokens.size
    values[0, o + 5] = float("inf")  # inside sample 1 only

    def span_loss(b, sl):
        return values[b, sl].sum()
    assert nonfinite_groups(mb, span_loss) == {"b": "non_finite"}


def test_run_pass_one_rank():
    assert run_pass(lambda: 3, lambda: None) == (3, None)
    err = RoutingAgreementError("low", {"g": "why"})

    def agreement():
        raise err
    assert run_pass(agreement, lambda: None) == (None, Fault({"g": "routing_agreement"}))

    def peer():
        raise PeerFault("vote")
    assert run_pass(peer, lambda: None, {"g": "non_finite"})[1] == Fault({"g": "non_finite"})

    def bug():
        raise KeyError("x")
    with pytest.raises(KeyError):
        run_pass(bug, lambda: None)
    assert issubclass(RankFailed, RuntimeError)
