"""Prompts and rewards as RL users have them: verl-format parquet, chat templates (a real HF
tokenizer with a template set here), math equivalence, custom / async / remote rewards and the
failure policy of the reward runner (no engine)."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.procenv import pythonpath
from services.common.tiny_moe import build_tokenizer
from services.rollout.agent import ChatSession
from services.rollout.config import PromptConfig, RewardConfig, RolloutConfig
from services.rollout.dataset import PromptRenderer, load_dataset
from services.rollout.math_grader import answers_equal, final_answer, math_reward
from services.rollout.report import RepeatedLog
from services.rollout.rewards import RewardRunner, build_registry
from services.rollout.verifiers import RewardInput, bind

# A Qwen3-like template in the character tokenizer's alphabet: roles in markers, a generation
# prompt, and `enable_thinking=False` writing an empty think block.
TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>{%- endif -%}"
    "{%- endif -%}")


@pytest.fixture
def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def runner(**cfg) -> tuple[RewardRunner, CollectorRegistry]:  # noqa: ANN003
    registry = CollectorRegistry()
    metrics = create_metrics(registry, "rollout")
    errors = RepeatedLog(logging.getLogger("test.rewards"))
    return RewardRunner(RewardConfig(**cfg), metrics, errors), registry


def failures(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("r3flow_rollout_reward_failures_total",
                                     {"reason": reason}) or 0.0


def write_verl_parquet(path, rows):  # noqa: ANN001, ANN201
    """Rows in verl's layout (examples/data_preprocess/gsm8k.py): messages prompt, struct
    reward_model and extra_info."""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(i: int, question: str, answer: str | None) -> dict:
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": 100 + i, "question": question}}


# ---- datasets and templates ----------------------------------------------------------------
def test_verl_parquet_loads_unchanged_and_names_a_bad_row(tmp_path):
    p = write_verl_parquet(tmp_path / "train.parquet", [
        verl_row(0, "What is 2+2?", "4"), verl_row(1, "What is 3*3?", None),
        verl_row(2, "Half of 1?", "\\frac{1}{2}")])
    lines: list[str] = []
    recs = load_dataset(p, PromptConfig(columns="verl"), on_bad_row=lines.append)
    assert [r.prompt_id for r in recs] == ["100", "102"]
    assert recs[0].messages == ({"role": "user", "content": "What is 2+2?"},)
    assert recs[0].answer == "4" and recs[0].data_source == "openai/gsm8k"
    assert recs[0].extra["extra_info"]["split"] == "train"
    assert recs[0].extra["ability"] == "math" and "prompt" not in recs[0].extra
    assert lines == [f"{p} row 1: skipped: column 'reward_model.ground_truth': answer missing"]


def test_column_map_overrides_the_preset(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "1+1=", "sol": {"final": 2}, "source": "toy"}]),
                   p)
    cfg = PromptConfig(columns="verl", column_map={"prompt": "q", "answer": "sol.final"})
    (rec,) = load_dataset(p, cfg)
    assert (rec.prompt, rec.answer, rec.prompt_id) == ("1+1=", "2", "0")
    assert rec.extra == {"source": "toy", "sol": {"final": 2}}  # a struct stays whole
    with pytest.raises(ValueError, match=r"prompts.column_map: unknown field\(s\) \['question'\]"):
        load_dataset(p, PromptConfig(column_map={"question": "q"}))


def test_messages_prompt_through_the_chat_template(tokenizer, tmp_path):
    p = write_verl_parquet(tmp_path / "d.parquet", [verl_row(0, "What is 2+2?", "4")])
    (rec,) = load_dataset(p, PromptConfig(columns="verl"))
    cfg = PromptConfig(system_prompt="Be brief.", chat_template_kwargs={"enable_thinking": False})
    out = PromptRenderer(tokenizer, cfg).render(rec)
    assert out.text == ("<|system|>Be brief.<|end|><|user|>What is 2+2?<|end|>"
                        "<|assistant|><think></think>")
    assert tokenizer.decode(out.token_ids) == out.text and len(out.token_ids) == len(out.text)
    assert out.messages is not None and out.messages[0]["role"] == "system"
    plain = PromptRenderer(tokenizer, PromptConfig(add_generation_prompt=False)).render(rec)
    assert plain.text == "<|user|>What is 2+2?<|end|>"


def test_text_prompts_raw_unless_always(tokenizer, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "2+2=", "answer": 4}\n')
    (rec,) = load_dataset(p)
    assert PromptRenderer(tokenizer, PromptConfig()).render(rec).text == "2+2="
    always = PromptRenderer(tokenizer, PromptConfig(chat_template="always")).render(rec)
    assert always.text == "<|user|>2+2=<|end|><|assistant|>"
    m = tmp_path / "m.jsonl"
    m.write_text('{"prompt": [{"role": "user", "content": "x"}], "answer": 1}\n')
    lines: list[str] = []
    with pytest.raises(ValueError, match="no good rows"):
        load_dataset(m, PromptConfig(chat_template="never"), on_bad_row=lines.append)
    assert lines == [f"{m}:1: skipped: column 'prompt': a messages prompt, and "
                     "prompts.chat_template is never"]


def test_template_failure_names_the_prompt(tmp_path):
    tok = build_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    p = tmp_path / "d.jsonl"
    p.write_text('{"id": "q7", "prompt": [{"role": "user", "content": "x"}], "answer": 1}\n')
    (rec,) = load_dataset(p)
    with pytest.raises(ValueError, match="prompt q7: chat template failed: .*roles must alt"):
        PromptRenderer(tok, PromptConfig()).render(rec)


def test_environment_messages_render_as_appended_tokens(tokenizer):
    renderer = PromptRenderer(tokenizer, PromptConfig(chat_template_kwargs={
        "enable_thinking": False}))
    chat = ChatSession(renderer, [{"role": "user", "content": "6*7?"}])
    chat.assistant(tokenizer.encode("call calc<eos>"))
    ids = chat.reply([{"role": "tool", "content": "42"}])
    assert tokenizer.decode(ids) == "<|tool|>42<|end|><|assistant|><think></think>"
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1]["content"] == "call calc"  # special tokens dropped


# ---- the math verifier ---------------------------------------------------------------------
@pytest.mark.parametrize("response,truth,equal", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", True),
    ("The answer is 1,234.", "1234", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{(2, 1)}", "(1,2)", False),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{\\text{yes}}", "yes", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sin(\\pi/3)", True),
    ("\\boxed{\\pi}", "3.14159", False),
    ("#### 72", "72", True),
    ("42 then 41", "42", False),
    ("no answer", "5", False),
    ("\\boxed{3}", "\\boxed{3}", True),
])
def test_math_equivalence(response, truth, equal):  # noqa: ANN001
    assert math_reward(response, truth) == float(equal)


def test_final_answer_takes_the_last_balanced_box():
    assert final_answer("\\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert final_answer("x = 3, y = 4") == "4"
    assert final_answer("") is None
    assert not answers_equal("x", "y")


# ---- custom rewards, the runner's failure policy -------------------------------------------
def judge(response: str, answer: str, *, prompt: str, extra: dict) -> dict:
    """A custom reward that reads the prompt and the row's extra fields."""
    return {"score": float(answer in response), "prompt_len": len(prompt),
            "index": extra["extra_info"]["index"], "note": "ignored (not a number)"}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # noqa: ANN001, ANN201
    """verl's custom_reward_function signature, unchanged."""
    return 1.0 if data_source == "openai/gsm8k" and extra_info["index"] == 100 and \
        ground_truth in solution_str else 0.0


SAMPLE = RewardInput("thus \\boxed{4}", "4", "<|user|>What is 2+2?", "100", "openai/gsm8k",
                     {"extra_info": {"index": 100}})


def test_custom_rewards_see_prompt_and_metadata():
    rewards, _ = runner()
    got = asyncio.run(rewards.score(bind("judge", judge), SAMPLE))
    assert got.score == 1.0 and got.failure is None
    assert got.components == {"prompt_len": len(SAMPLE.prompt), "index": 100.0}
    verl = asyncio.run(rewards.score(bind("verl", compute_score), SAMPLE))
    assert verl.score == 1.0
    assert asyncio.run(rewards.score(build_registry(RewardConfig()).get("math"), SAMPLE)).score \
        == 1.0


def test_format_verifier_uses_the_configured_pattern():
    registry = build_registry(RewardConfig(format_pattern=r"^<think>.*</think>"))
    fn = registry.get("format")
    assert fn.call(RewardInput("<think>a\nb</think> 4", "4")) == 1.0
    assert fn.call(RewardInput("4", "4")) == 0.0
    assert build_registry(RewardConfig()).get("format").call(SAMPLE) == 1.0


def boom(response: str, answer: str) -> float:
    raise RuntimeError("judge crashed")


@pytest.mark.parametrize("fn,reason", [
    (boom, "error"),
    (lambda r, a: math.nan, "invalid"),
    (lambda r, a: "high", "invalid"),
    (lambda r, a: {"correct": 1.0}, "invalid"),
])
def test_failing_rewards_score_the_fallback_counted(fn, reason):  # noqa: ANN001
    rewards, registry = runner(fallback=-1.0)
    got = asyncio.run(rewards.score(bind("bad", fn), SAMPLE))
    assert (got.score, got.failure) == (-1.0, reason)
    assert failures(registry, reason) == 1.0
    assert sum(failures(registry, r) for r in ("timeout", "error", "invalid")) == 1.0


def test_slow_async_reward_does_not_block_other_rewards():
    async def main() -> None:
        rewards, _ = runner(max_concurrency=4)
        started, gate = asyncio.Event(), asyncio.Event()

        async def slow_judge(response: str, answer: str) -> float:
            started.set()
            await gate.wait()
            return 0.5
        slow = asyncio.create_task(rewards.score(bind("slow", slow_judge), SAMPLE))
        await started.wait()
        fast = await rewards.score(build_registry(RewardConfig()).get("math"), SAMPLE)
        assert fast.score == 1.0 and not slow.done()  # scored while the judge still waits
        gate.set()
        assert (await slow).score == 0.5
    asyncio.run(main())


def test_slow_sync_reward_runs_off_the_loop():
    async def main() -> None:
        rewards, _ = runner(max_concurrency=2)
        started, gate = threading.Event(), threading.Event()

        def blocking_judge(response: str, answer: str) -> float:
            started.set()
            gate.wait()
            return 0.25
        slow = asyncio.create_task(rewards.score(bind("blocking", blocking_judge), SAMPLE))
        await asyncio.to_thread(started.wait)
        ticked = asyncio.Event()
        asyncio.get_running_loop().call_soon(ticked.set)
        await ticked.wait()  # the loop turns while the judge blocks its thread
        assert not slow.done()
        gate.set()
        assert (await slow).score == 0.25
    asyncio.run(main())


def test_hung_reward_times_out_and_its_slot_bounds_the_rest():
    async def main() -> None:
        rewards, registry = runner(max_concurrency=1, timeout_s=0.05, fallback=0.0)
        gate = threading.Event()

        def hung(response: str, answer: str) -> float:
            gate.wait()
            return 1.0
        first = await rewards.score(bind("hung", hung), SAMPLE)
        # The hung call still holds the only slot: the next waits for it only its deadline.
        second = await rewards.score(bind("math", math_reward), SAMPLE)
        assert (first.failure, second.failure) == ("timeout", "timeout")
        assert failures(registry, "timeout") == 2.0
        gate.set()
    asyncio.run(main())


def test_remote_reward_over_http_on_loopback():
    async def main() -> None:
        seen: list[dict] = []

        async def grade(request: web.Request) -> web.Response:
            body = await request.json()
            seen.append(body)
            if body["prompt_id"] == "crash":
                return web.Response(status=500)
            return web.json_response({"score": float(body["ground_truth"] in body["response"]),
                                      "chars": len(body["response"])})
        app = web.Application()
        app.router.add_post("/grade", grade)
        server = web.AppRunner(app)
        await server.setup()
        site = web.TCPSite(server, "127.0.0.1", 0)
        await site.start()
        port = server.addresses[0][1]
        try:
            cfg = RewardConfig(remote_url=f"http://127.0.0.1:{port}/grade")
            rewards, registry = runner(**cfg.model_dump())
            remote = build_registry(cfg).get("remote")
            got = await rewards.score(remote, SAMPLE)
            assert got.score == 1.0 and got.components == {"chars": len(SAMPLE.response)}
            assert seen[0]["prompt"] == SAMPLE.prompt and seen[0]["extra"] == dict(SAMPLE.extra)
            bad = await rewards.score(remote, RewardInput("x", "4", prompt_id="crash"))
            assert bad.failure == "error" and failures(registry, "error") == 1.0
            registry_ = build_registry(cfg)
            assert await registry_.get("remote").call(SAMPLE) == {"score": 1.0,
                                                                   "chars": len(SAMPLE.response)}
            await registry_.aclose()  # the worker's end of run: the session closed
            assert registry_.get("remote").call._session is None  # type: ignore[attr-defined]
            await remote.call.close()  # type: ignore[attr-defined]
        finally:
            await server.cleanup()
    asyncio.run(main())


def test_config_knobs_validate():
    base = {"engine": {"model": "m"}, "dataset": "d"}
    with pytest.raises(ValueError, match="reward.remote_url"):
        RolloutConfig.model_validate({**base, "verifier": "remote"})
    with pytest.raises(ValueError, match="format_pattern"):
        RolloutConfig.model_validate({**base, "reward": {"format_pattern": "(unclosed"}})
    with pytest.raises(ValueError, match="prompts.columns"):
        RolloutConfig.model_validate({**base, "prompts": {"columns": "slime"}})


def test_reward_module_on_the_pythonpath_loads(tmp_path):
    """What the chart's rollout.userCode does (a ConfigMap of modules mounted on PYTHONPATH):
    a reward module outside the image's packages resolves by `module:fn` in a fresh process."""
    import os
    import subprocess
    import sys

    code = tmp_path / "user-code"
    code.mkdir()
    (code / "my_rewards.py").write_text(
        "def score(response, answer, *, extra):\n"
        "    return {'score': float(answer in response), 'tag': extra['tag']}\n")
    probe = ("from services.rollout.config import RewardConfig\n"
             "from services.rollout.rewards import build_registry\n"
             "from services.rollout.verifiers import RewardInput\n"
             "fn = build_registry(RewardConfig()).get('my_rewards:score')\n"
             "print(fn.call(RewardInput('is 4', '4', extra={'tag': 7})))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": pythonpath(code, root)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.strip() == "{'score': 1.0, 'tag': 7}"


def test_local_task_prompts_render_to_the_warm_start_tokens(tmp_path):
    """`make run`'s RL prompts are messages through the tiny model's chat template; they must
    be the very tokens the warm start trained on (its text prompts)."""
    from services.local.tasks import TaskConfig, closeness_reward, write_datasets

    rl, _ = write_datasets(TaskConfig(num_prompts=3, num_sft_examples=1), tmp_path)
    tok = build_tokenizer()
    renderer = PromptRenderer(tok, PromptConfig())
    for rec in load_dataset(rl):
        assert rec.messages is not None and rec.prompt is None
        text = rec.messages[0]["content"]
        assert renderer.render(rec).token_ids == tok(text, add_special_tokens=False)["input_ids"]
        assert closeness_reward(f" {rec.answer}\n", rec.answer) == 1.0
        assert 1.0 > closeness_reward(str(int(rec.answer) + 1), rec.answer) > 0.0


def one_arg(sample):  # noqa: ANN001, ANN201
    return 1.0


def test_a_reward_that_cannot_take_its_call_shape_fails_at_load():
    with pytest.raises(ValueError, match="verifier: 'one_arg' cannot be called as fn"):
        bind("one_arg", one_arg)


def test_numpy_scores_are_numbers():
    import numpy as np

    rewards, _ = runner()
    got = asyncio.run(rewards.score(bind("np", lambda r, a: {"score": np.float32(0.5),
                                                             "len": np.int64(3)}), SAMPLE))
    assert (got.score, got.components, got.failure) == (0.5, {"len": 3.0}, None)
