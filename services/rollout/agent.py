"""The agent loop: turns of generation, environment tokens between turns, and resumption of
calls a weight update aborted (partial rollouts).

An `Environment` sees the whole token sequence after each turn and answers with tokens to
append (tool output, user reply) or None when the episode is over. A `MessagesEnvironment`
speaks messages instead: it sees the conversation (the prompt's messages, then each turn's
assistant message with the tool calls the model wrote) and answers with messages (role `tool`
or `user`), which the model's chat template renders into the tokens appended. Environment tokens are
loss-masked and get their routing from the next turn's prefill; every call asks only for rows
not yet held (`routed_experts_prompt_start`), so no row is requested or stored twice.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from services.rollout.config import SamplingConfig
from services.rollout.engine import CallParams, RolloutEngine
from services.rollout.segments import CallOutput, RolloutState


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (may also be `async def step`)."""

    def step(self, tokens_so_far: Sequence[int]) -> list[int] | None:
        """Tokens to append after a turn, or None when the episode is done."""
        ...


@runtime_checkable
class MessagesEnvironment(Protocol):
    """One episode's environment over messages (may also be `async def step_messages`)."""

    def step_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Messages to append after the assistant's turn, or None when the episode is done."""
        ...


class MessageRenderer(Protocol):
    """What a conversation needs of the prompt renderer (services.rollout.dataset)."""

    tokenizer: Any

    def message_ids(self, new: list[dict[str, Any]]) -> list[int]: ...


class ChatSession:
    """The messages of one trajectory, kept beside its tokens for a MessagesEnvironment."""

    def __init__(self, renderer: MessageRenderer, messages: list[dict[str, Any]]) -> None:
        self.renderer = renderer
        self.messages = messages

    def assistant(self, turn_ids: Sequence[int]) -> None:
        """Record the model's turn (its tokens, decoded) as an assistant message."""
        text = self.renderer.tokenizer.decode(list(turn_ids), skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})

    def reply(self, new: list[dict[str, Any]]) -> list[int]:
        """Record the environment's messages; the tokens that append them."""
        self.messages.extend(new)
        return self.renderer.message_ids(new)


# Builds the environment of one trajectory from its dataset row.
EnvironmentFactory = Callable[[Any], Environment | MessagesEnvironment]


def load_environment_factory(path: str | None) -> EnvironmentFactory | None:
    """`pkg.mod:factory` -> factory(record) -> Environment, or None for single-turn."""
    if path is None:
        return None
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ValueError(f"environment: expected `pkg.mod:factory`, got {path!r}")
    return getattr(importlib.import_module(module_name), attr)


@dataclass
class RolloutResult:
    """A finished trajectory's bookkeeping plus every raw engine call (for checks and tests)."""

    state: RolloutState
    finish_reason: str
    calls: list[CallOutput] = field(default_factory=list)
    reward: float | None = None  # set by the worker's verifier
    reward_components: dict[str, float] = field(default_factory=dict)


def call_seed(seed: int | None, call_index: int) -> int | None:
    """Distinct, reproducible seed of each call of one trajectory."""
    return None if seed is None else (seed * 1_000_003 + call_index) % (1 << 63)


async def _env_step(env: Environment | MessagesEnvironment, tokens: list[int],
                    turn_start: int, chat: ChatSession | None) -> list[int] | None:
    """The environment's answer to a turn as tokens (messages rendered through `chat`)."""
    if chat is None:
        assert isinstance(env, Environment)
        ids: Any = env.step(tokens)
        ids = await ids if inspect.isawaitable(ids) else ids
        return None if ids is None else [int(t) for t in ids]
    assert isinstance(env, MessagesEnvironment)
    chat.assistant(tokens[turn_start:])
    new: Any = env.step_messages(list(chat.messages))
    new = await new if inspect.isawaitable(new) else new
    return None if new is None else chat.reply(list(new))


class AgentLoop:
    """Runs one trajectory on an engine: turns, environment steps, resumes after aborts."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingConfig, *,
                 policy: str = "segment") -> None:
        self.engine = engine
        self.sampling = sampling
        self.policy = policy

    async def run(self, request_id: str, prompt_ids: list[int], *, seed: int | None = None,
                  env: Environment | MessagesEnvironment | None = None,
                  chat: ChatSession | None = None) -> RolloutResult:
        """Generate until the environment is done, max_turns, or the context is full; `chat`
        is the conversation of a MessagesEnvironment."""
        self.engine.validate_prompt(request_id, prompt_ids)
        result = RolloutResult(RolloutState(list(prompt_ids), policy=self.policy), "stop")
        for turn in range(self.sampling.max_turns):
            turn_start = len(result.state.context_ids())
            result.finish_reason = await self._turn(request_id, result, seed)
            if env is None or turn + 1 == self.sampling.max_turns:
                break
            env_ids = await _env_step(env, result.state.context_ids(), turn_start, chat)
            if env_ids is None:
                break
            if len(result.state.context_ids()) + len(env_ids) >= self.engine.cfg.max_model_len:
                result.finish_reason = "length"  # no room for the reply and one more token
                break
            result.state.add_env_tokens(env_ids)
        return result

    async def _turn(self, request_id: str, result: RolloutResult, seed: int | None) -> str:
        """One turn: call, and re-call with prompt + generated after every abort."""
        budget = self.sampling.max_tokens
        while True:
            state = result.state
            context = state.context_ids()
            room = min(budget, self.engine.cfg.max_model_len - len(context))
            if room <= 0:
                return "length"
            k = len(result.calls)
            params = CallParams(
                max_tokens=room, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                seed=call_seed(seed, k), ignore_eos=self.sampling.ignore_eos,
                routed_prompt_start=state.request_start_row())
            if k and result.calls[-1].finish_reason == "abort":
                self.engine.metrics["r3flow_rollout_resumes_total"].inc()
            call = await self.engine.generate(f"{request_id}#{k}", context, params)
            result.calls.append(call)
            state.close_call(call)
            budget -= len(call.token_ids)
            if call.finish_reason != "abort":
                return call.finish_reason
