"""The rollout worker: prompts -> GRPO groups of n samples on the engine -> rewards -> routing
checks -> the store. Also the weight-update entry points (pause, load, resume, report).

A group is sent only when all of its samples finished and passed the routing checks, so the
store never holds a group that can not complete; a bad request fails its own group only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.rollout.agent import (
    AgentLoop,
    ChatSession,
    EnvironmentFactory,
    MessagesEnvironment,
    RolloutResult,
)
from services.rollout.capture_check import AfterLoadCheck
from services.rollout.config import RolloutConfig
from services.rollout.dataset import PromptRecord, PromptRenderer, RenderedPrompt, iterate_prompts
from services.rollout.engine import EngineDead, RolloutEngine
from services.rollout.evaluation import Evaluator
from services.rollout.report import RepeatedLog, WorkerSummary, write_json_atomic
from services.rollout.rewards import Reward, RewardRunner, build_registry
from services.rollout.sample_finish import finish_sample
from services.rollout.segments import RoutingCheckError
from services.rollout.sink import TrajectorySink
from services.rollout.spill import RoutingSpill
from services.rollout.trainer_gate import TrainerGate
from services.rollout.trajectory_proto import RoutingLayout, TrajectoryMeta
from services.rollout.verifiers import RewardFn, RewardInput

log = logging.getLogger(__name__)

MAX_KEPT_ERRORS = 100  # a long run keeps the first messages; every failure is counted
MAX_FAILURE_BACKOFF_S = 2.0  # the longest a failed group holds its slot (failures in a row)
FATAL_GRACE_S = 5.0  # after a fatal error, groups still sending to the store may finish
ENGINE_WATCH_S = 1.0  # how often the engine watch asks whether the engine died


@dataclass
class GroupResult:
    """A finished group: the raw per-sample bookkeeping, and the wire trajectories (empty when
    the worker has no sink)."""

    trajectories: list[trajectory_pb2.Trajectory]
    results: list[RolloutResult]
    generated_tokens: int
    spill: RoutingSpill | None = None  # the group's routing on disk (closed once sent)


class RolloutWorker:
    """Drives one engine over a dataset; owns the group bookkeeping and the sink."""

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, sink: TrajectorySink | None,
                 tokenizer: Any, env_factory: EnvironmentFactory | None = None) -> None:
        self.cfg = cfg
        self.engine = engine
        self.sink = sink
        self.tokenizer = tokenizer
        self.env_factory = env_factory
        self.prompts = PromptRenderer(tokenizer, cfg.prompts)
        self.verifiers = build_registry(cfg.reward)
        self.verifiers.get(cfg.verifier)  # an unknown default verifier fails at boot
        self._errors = RepeatedLog(log)
        self.rewards = RewardRunner(cfg.reward, engine.metrics, self._errors)
        self.loop = AgentLoop(engine, cfg.sampling, policy=cfg.partial_rollout_policy)
        self.layout = RoutingLayout(engine.info.num_experts, engine.info.moe_layers,
                                    cfg.routing_codec_mode, cfg.routing_chunk_rows)
        self.metrics = engine.metrics
        if sink is not None and not engine.cfg.capture_routing:
            log.warning("engine.capture_routing is off: groups are not sent to the store "
                        "(it requires routing for every segment)")
        # The trainer's presence and version, the store's budget: when a new group may start
        self.gate = TrainerGate(cfg, engine, sink, engine.metrics)
        # The routing capture check after each weight load (services/rollout/capture_check.py)
        self.capture_check = AfterLoadCheck(engine, cfg.sampling, cfg.engine.seed,
                                            cfg.partial_rollout_policy, self._refuse)
        self.refusal: str | None = None
        # Keep each sample's routing arrays as the engine returned them in GroupResult.results
        # (tests compare them with what was sent); off, they are dropped once encoded.
        self.keep_engine_routing = False
        self._nonce = uuid.uuid4().hex[:8]
        self._requests = asyncio.Semaphore(cfg.concurrency)
        self._stop = asyncio.Event()
        self._failures_in_row = 0
        # Called with the live summary whenever a group starts or ends (progress file).
        self.on_progress: Callable[[WorkerSummary], None] = lambda _: None
        self.evaluator = self._evaluator() if cfg.eval is not None and cfg.eval.runs_on(
            cfg.shard_index) else None

    def _evaluator(self) -> Evaluator:
        """The held-out scorer (services.rollout.evaluation): greedy and n-sample loops over
        this engine, every request under the worker's request limit."""
        ev, sp = self.cfg.eval, self.cfg.sampling
        assert ev is not None
        sampled = sp.model_copy(update={"max_tokens": ev.max_tokens or sp.max_tokens})
        greedy = sampled.model_copy(update={"n": 1, "temperature": 0.0})
        policy = self.cfg.partial_rollout_policy
        return Evaluator(ev, AgentLoop(self.engine, greedy, policy=policy),
                         AgentLoop(self.engine, sampled, policy=policy), self.reward_of,
                         self.prompts.render, self._limited, self.metrics)

    async def _limited(self, aw: Any) -> Any:
        async with self._requests:
            return await aw

    def _maybe_eval(self) -> None:
        """Start a held-out score of the weights served now, when one is due."""
        v = self.engine.policy_version
        if self.evaluator is not None and self.evaluator.due(v):
            self.evaluator.start(v, lambda: self.engine.policy_version)

    def request_stop(self) -> None:
        """Take no new prompt; `run` lets in-flight groups finish within its grace period."""
        self._stop.set()

    def _refuse(self, line: str) -> None:
        """The capture check after a weight load failed: no new prompt; `run` ends fatal."""
        self.fail(line, "refuses to serve")

    def fail(self, cause: str, what: str = "stops") -> None:
        """A duty beside `run` failed (a store watch, the capture check): no new prompt; `run`
        ends fatal with `cause` (one line), logged once."""
        if self.refusal is None:
            self.refusal = cause
            log.critical("rollout %s %s: %s", self.cfg.worker_id, what, cause)
        self._stop.set()

    # ---- the main loop ---------------------------------------------------------------------
    async def run(self, records: list[PromptRecord], stop_grace_s: float = 30.0
                  ) -> WorkerSummary:
        """Roll out `epochs` passes (or `num_prompts` groups) over `records`; after
        `request_stop`, groups still running `stop_grace_s` later are cancelled (abandoned)."""
        summary, t0 = WorkerSummary(), time.perf_counter()
        if self.evaluator is not None and self.evaluator.cfg.only:
            summary.eval = await self.evaluator.run(self.engine.policy_version,
                                                    lambda: self.engine.policy_version)
            summary.seconds = time.perf_counter() - t0
            await self._until_stop(asyncio.sleep(self.evaluator.cfg.linger_s))
            await self.verifiers.aclose()
            return summary
        if self.evaluator is not None:  # the weights it starts on, whatever their version
            self.evaluator.start(self.engine.policy_version, lambda: self.engine.policy_version)
        # Twice the groups the engine can hold: a group that is being sent keeps its slot
        # without starving the engine, and when the store pushes back, sending groups fill
        # every slot and no new group starts (the worker slows down, nothing is dropped).
        slots = asyncio.Semaphore(2 * max(1, -(-self.cfg.concurrency // self.cfg.sampling.n)))
        tasks: set[asyncio.Task] = set()
        watchdog = asyncio.create_task(self._watch_engine(summary))
        cfg = self.cfg
        prompts = iterate_prompts(records, cfg.epochs, cfg.num_prompts, shard=cfg.shard_index,
                                  num_shards=cfg.num_shards, shuffle=cfg.shuffle,
                                  seed=cfg.data_seed)
        for seq, (epoch, rec) in enumerate(prompts):
            if not await self._until_stop(slots.acquire()):
                break
            # A stop may come while a free slot is taken at once (groups that fail at once on
            # a dead engine free theirs at once): check it before every new group.
            if self._stop.is_set() or not await self._until_stop(self.gate.wait_for_room(summary)):
                slots.release()
                break
            task = asyncio.create_task(self._group_task(seq, epoch, rec, summary))
            summary.groups_started += 1
            self.on_progress(summary)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(lambda _: slots.release())
        summary.stopped_early = self._stop.is_set()
        summary.fatal = summary.fatal or self.refusal
        watchdog.cancel()
        grace = min(stop_grace_s, FATAL_GRACE_S) if summary.fatal else stop_grace_s
        await self._finish_in_flight(set(tasks), summary, grace)
        if self.evaluator is not None:
            await self.evaluator.finish(grace)
            summary.eval = list(self.evaluator.rows)
        summary.seconds = time.perf_counter() - t0
        await self.verifiers.aclose()
        self._errors.flush()
        return summary

    async def _watch_engine(self, summary: WorkerSummary) -> None:
        """Notice a dead engine even when no call is running (all groups waiting on the store
        or on the policy lag)."""
        while True:
            await asyncio.sleep(ENGINE_WATCH_S)
            try:
                reason = self.engine.dead_reason()
            except Exception as e:  # a bug in the watch: run must not go on unwatched
                log.exception("engine watch failed")
                self._fail(summary, f"{type(e).__name__} in the engine watch: {e}")
                return
            if reason is not None:
                self._fail(summary, f"engine dead: {reason}")
                return

    def _fail(self, summary: WorkerSummary, cause: str) -> None:
        """A fatal error: keep the first cause, log it once, take no new prompt."""
        if summary.fatal is None:
            summary.fatal = cause
            log.critical("rollout stops: %s", cause)
        self._stop.set()

    async def _until_stop(self, aw: Any) -> bool:
        """Await `aw` unless a stop is requested first (then cancel it); True if it finished."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            task.result()
            return True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False

    async def _finish_in_flight(self, tasks: set[asyncio.Task], summary: WorkerSummary,
                                grace_s: float) -> None:
        """Wait for running groups (all of them, or `grace_s` once a stop was requested);
        cancel the rest: their requests are aborted and nothing of them is counted as sent."""
        started = set(tasks)
        while tasks and not self._stop.is_set():
            await self._until_stop(asyncio.wait(tasks))
            tasks = {t for t in tasks if not t.done()}
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            summary.groups_abandoned += len(late)
            summary.trajectories_abandoned += len(late) * self.cfg.sampling.n
        self.on_progress(summary)
        for t in started:  # an unexpected error (not a failed group) still ends the worker
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    async def _group_task(self, seq: int, epoch: int, rec: PromptRecord,
                          summary: WorkerSummary) -> None:
        group_id = f"{self.cfg.worker_id}-{self._nonce}-g{seq}"
        try:
            group = await self.run_group(group_id, rec, seed=self._group_seed(seq), epoch=epoch)
            try:
                if self.sink is not None and self.engine.cfg.capture_routing:
                    await self.sink.send_group(group.trajectories, group.spill)
            finally:
                if group.spill is not None:
                    group.spill.close()
        except ValueError as e:  # bad input, failed routing check, store refusal: this group
            summary.groups_failed += 1
            if len(summary.errors) < MAX_KEPT_ERRORS:
                summary.errors.append(f"group {group_id} (prompt {rec.prompt_id}): {e}")
            summary.trajectories_failed += self.cfg.sampling.n
            outcome = "routing_check_failed" if isinstance(e, RoutingCheckError) else "error"
            self.metrics["r3flow_rollout_trajectories_total"].labels(outcome).inc(
                self.cfg.sampling.n)
            self._errors.error(f"group {group_id} (prompt {rec.prompt_id}, epoch {epoch}) "
                               f"failed: {e}")
            self.on_progress(summary)
            # Failures in a row hold their slot a little longer each time (up to
            # MAX_FAILURE_BACKOFF_S), so a cause that fails every group cannot spin the loop.
            self._failures_in_row += 1
            backoff = 0.01 * 2 ** min(self._failures_in_row, 10)
            await asyncio.sleep(min(MAX_FAILURE_BACKOFF_S, backoff))
            return
        except Exception as e:  # a dead engine or a bug: no later group can do better
            summary.groups_abandoned += 1
            summary.trajectories_abandoned += self.cfg.sampling.n
            cause = (f"engine dead: {e}" if isinstance(e, EngineDead)
                     else f"{type(e).__name__} in group {group_id}: {e}")
            if not isinstance(e, EngineDead):
                log.exception("group %s failed unexpectedly", group_id)
            self._fail(summary, cause)
            self.on_progress(summary)
            return
        self._failures_in_row = 0
        summary.groups_ok += 1
        summary.trajectories_sent += len(group.trajectories)
        summary.generated_tokens += group.generated_tokens
        self.metrics["r3flow_rollout_trajectories_total"].labels("ok").inc(len(group.results))
        self.on_progress(summary)

    def _group_seed(self, seq: int) -> int:
        """Seed of this worker's `seq`-th group: distinct across the shards of a fleet."""
        return self.cfg.engine.seed + seq * self.cfg.num_shards + self.cfg.shard_index

    async def run_group(self, group_id: str, rec: PromptRecord, seed: int | None = None,
                        epoch: int = 0) -> GroupResult:
        """n samples of one prompt -> rewards (each as its sample ends), routing checks, wire
        trajectories."""
        verifier = self.verifiers.get(rec.verifier or self.cfg.verifier)
        prompt = self.prompts.render(rec)
        self.engine.validate_prompt(group_id, prompt.token_ids)
        n = self.cfg.sampling.n
        run_id = self.engine.run_id  # the run whose weights sample this group (run fencing)
        metas = [TrajectoryMeta(f"{group_id}-{i}", group_id, n, rec.prompt_id,
                                self.cfg.worker_id, epoch, run_id) for i in range(n)]
        spill = RoutingSpill(self.cfg.spill_routing_bytes, self.cfg.spill_routing_dir)
        try:
            results = await asyncio.gather(*[
                self._sample(meta, prompt, rec, verifier,
                             None if seed is None else seed * 1009 + i, spill)
                for i, meta in enumerate(metas)], return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise failed[0]
        except BaseException:  # failed or cancelled: nothing of the group is sent
            spill.close()
            raise
        done = [r for r in results if isinstance(r, tuple)]
        trajs = spill.trajectories([m.trajectory_id for m in metas])
        tokens = sum(sum(s.loss_mask) for res, _ in done for s in res.state.segments)
        return GroupResult(trajs, [res for res, _ in done], tokens, spill)

    async def _sample(self, meta: TrajectoryMeta, prompt: RenderedPrompt, rec: PromptRecord,
                      verifier: RewardFn, seed: int | None, spill: RoutingSpill | None = None
                      ) -> tuple[RolloutResult, trajectory_pb2.Trajectory | None]:
        """One trajectory, checked and encoded as soon as it ends (the engine's routing arrays
        are dropped then, not when the group ends), then its reward (off the loop; the engine
        slot is free by then)."""
        env = self.env_factory(rec) if self.env_factory is not None else None
        chat = self._chat(prompt, env)
        async with self._requests:
            res = await self.loop.run(meta.trajectory_id, prompt.token_ids, seed=seed, env=env,
                                      chat=chat)
        traj = finish_sample(self.engine, self.layout, self.sink is not None,
                             self.keep_engine_routing, meta, res)
        reward = await self.reward_of(res, rec, prompt, verifier)
        res.reward, res.reward_components = reward.score, reward.components
        if traj is not None:
            traj.reward = reward.score
            traj.reward_components.update(reward.components)
            if spill is not None:  # the group's trajectories are the spill's (spill.py)
                await asyncio.to_thread(spill.keep, traj)  # a write: off the event loop
                traj = None
        return res, traj

    async def reward_of(self, res: RolloutResult, rec: PromptRecord, prompt: RenderedPrompt,
                        verifier: RewardFn | None = None) -> Reward:
        """The reward of a finished result's response text (through the reward runner: off the
        loop, bounded, the fallback on failure); `verifier`: the record's, else the config's."""
        verifier = verifier or self.verifiers.get(rec.verifier or self.cfg.verifier)
        text = self.tokenizer.decode(res.state.response_ids, skip_special_tokens=True)
        return await self.rewards.score(verifier, RewardInput(
            text, rec.answer, prompt.text, rec.prompt_id, rec.data_source, rec.extra))

    def _chat(self, prompt: RenderedPrompt, env: Any) -> ChatSession | None:
        """The conversation a messages environment speaks (None for a token environment)."""
        if not isinstance(env, MessagesEnvironment):
            return None
        return ChatSession(self.prompts, list(prompt.messages or
                                              [{"role": "user", "content": prompt.text}]))

    # ---- weight updates and policy lag -----------------------------------------------------
    async def update_weights_from_file(self, path: str, version: int | None = None) -> int:
        """Pause (in-flight requests are aborted, later resumed), load, resume, report."""
        count = await self.engine.load_safetensors_file(path, version=version)
        self.capture_check.after_load(self.engine.policy_version)
        await self.report_version()
        self._maybe_eval()
        return count

    async def update_weights_from_tensors(self, named: dict[str, Any],
                                          version: int | None = None) -> int:
        count = await self.engine.load_named_tensors(named, version=version)
        self.capture_check.after_load(self.engine.policy_version)
        await self.report_version()
        self._maybe_eval()
        return count

    async def apply_weight_sync(self, plan: Any) -> int:
        """Receive a trainer push (a `WeightSyncPlan`) into the engine under pause/resume;
        EngineDead when the engine is gone."""
        reason = self.engine.dead_reason()
        if reason is not None:
            raise EngineDead(reason)
        if plan.version <= self.engine.policy_version:
            log.warning("weight sync v%d ignored: engine already serves v%d", plan.version,
                        self.engine.policy_version)
            return 0
        digests = self.cfg.weight_digests_file
        count = await self.engine.update_weights(
            "receive_weights", plan.SerializeToString(), self.cfg.worker_id, bool(digests),
            version=plan.version, torn_on_failure=True)  # loaded as it arrives
        self.engine.run_id = plan.run_id  # groups begun from now on are this run's
        self.capture_check.after_load(plan.version)
        if digests:
            got = (await self.engine.llm.collective_rpc("last_load_digests"))[0]
            write_json_atomic(digests, {"version": plan.version, "worker_id": self.cfg.worker_id,
                                        "digests": got})
        await self.report_version()
        self._maybe_eval()
        return count

    async def report_version(self) -> int | None:
        """Tell the store which policy version this worker serves (RegisterWorker); returns
        the registration's TTL in seconds (None without a store)."""
        if self.sink is None:
            return None
        return await self.sink.report_version(self.cfg.worker_id, self.engine.policy_version,
                                              await self.engine.engine_gpu(),
                                              self.engine.run_id)
