"""Verifiers, dataset loading, config and CLI overrides of the rollout worker (no engine)."""

import argparse
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.config import ConfigError, build_config
from services.rollout import cli
from services.rollout.config import RolloutConfig
from services.rollout.dataset import iterate_prompts, load_dataset
from services.rollout.verifiers import (
    RewardInput,
    VerifierRegistry,
    exact_match,
    last_number,
    numeric,
)


def my_verifier(response: str, answer: str) -> float:
    return float(len(response) == len(answer))


NOT_CALLABLE = 3


def test_exact_match():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42.0", "42") == 0.0


@pytest.mark.parametrize("text,value", [
    ("the answer is 1,234.5", 1234.5), ("x=-3 then 7", 7.0), ("1e3", 1000.0), ("none", None),
])
def test_last_number(text, value):  # noqa: ANN001
    assert last_number(text) == value


def test_numeric():
    assert numeric("so it is 42.0", "42") == 1.0
    assert numeric("so it is 41", "42") == 0.0
    assert numeric("no digits", "42") == 0.0


def test_registry_builtin_and_import_path():
    reg = VerifierRegistry()
    assert reg.get("numeric") is reg.get("numeric")  # resolved once
    assert reg.get("numeric").call(RewardInput("so 42.0", "42")) == 1.0
    fn = reg.get(f"{__name__}:my_verifier")
    assert fn.call(RewardInput("abc", "xyz")) == 1.0 and not fn.is_async


@pytest.mark.parametrize("name,match", [
    ("nope", "unknown verifier 'nope'"),
    ("no_such_module_x:fn", "cannot load"),
    (f"{__name__}:missing", "cannot load"),
    (f"{__name__}:NOT_CALLABLE", "not callable"),
])
def test_registry_errors_name_the_field(name, match):  # noqa: ANN001
    with pytest.raises(ValueError, match=f"verifier: .*{match}|verifier: {match}"):
        VerifierRegistry().get(name)


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "prompt": "1+1=", "answer": 2},
        {"prompt_token_ids": [5, 6, 7], "answer": "x", "verifier": "numeric"},
    ]) + "\n\n")
    recs = load_dataset(p)
    assert recs[0].prompt_id == "a" and recs[0].answer == "2"
    assert recs[0].token_ids(lambda s: [ord(c) for c in s]) == [49, 43, 49, 61]
    assert recs[1].prompt_id == "1" and recs[1].token_ids(None) == [5, 6, 7]
    assert recs[1].verifier == "numeric"


def test_parquet_dataset(tmp_path):
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), p)
    recs = load_dataset(p)
    assert [r.prompt for r in recs] == ["a", "b"] and recs[1].prompt_id == "1"


@pytest.mark.parametrize("row,match", [
    ({"answer": 1}, "column 'prompt': exactly one of `prompt` and `prompt_token_ids`"),
    ({"prompt": "a", "prompt_token_ids": [1], "answer": 1}, "column .prompt.: exactly one"),
    ({"prompt": "a"}, "column 'answer': answer missing"),
    ({"prompt_token_ids": [1, -2], "answer": 1},
     "column 'prompt_token_ids': expected a list of non-negative ints"),
    ({"prompt": "a", "answer": 1, "extra": 0}, "column 'extra': unknown"),
    ({"prompt": [{"content": "hi"}], "answer": 1}, "column 'prompt': message 0: `role`"),
    ({"prompt": 5, "answer": 1}, "column 'prompt': expected text or a list of messages"),
])
def test_bad_rows_are_skipped_with_one_line(tmp_path, row, match):  # noqa: ANN001
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "ok", "answer": 0}) + "\n" + json.dumps(row) + "\n"
                 + "{not json\n")
    lines: list[str] = []
    recs = load_dataset(p, on_bad_row=lines.append)
    assert [r.prompt for r in recs] == ["ok"]
    assert len(lines) == 2 and re.fullmatch(f".*d.jsonl:2: skipped: {match}.*", lines[0])
    assert "d.jsonl:3: skipped: invalid JSON" in lines[1]


def test_dataset_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_dataset(tmp_path / "none.jsonl")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match="unsupported format"):
        load_dataset(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no good rows"):
        load_dataset(tmp_path / "e.jsonl")
    (tmp_path / "f.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"no good rows \(1 bad\)"):
        load_dataset(tmp_path / "f.jsonl", on_bad_row=lambda _: None)


def test_iterate_prompts_epochs_and_limit():
    recs = ["a", "b", "c"]
    assert [r for _, r in iterate_prompts(recs, 2, None)] == recs * 2
    assert list(iterate_prompts(recs, 2, 4)) == [(0, "a"), (0, "b"), (0, "c"), (1, "a")]


def test_config_validation_names_keys():
    ok = build_config(RolloutConfig, {"engine": {"model": "m"}, "dataset": "d.jsonl"})
    assert ok.partial_rollout_policy == "segment" and ok.routing_codec_mode == "canonical"
    with pytest.raises(ConfigError, match="engine.block_size"):
        build_config(RolloutConfig, {"engine": {"model": "m", "block_size": 48},
                                     "dataset": "d"})
    with pytest.raises(ConfigError, match="partial_rollout_policy"):
        build_config(RolloutConfig, {"engine": {"model": "m"}, "dataset": "d",
                                     "partial_rollout_policy": "concat"})
    with pytest.raises(ConfigError, match="sampling.nn: unknown key"):
        build_config(RolloutConfig, {"engine": {"model": "m"}, "dataset": "d",
                                     "sampling": {"nn": 2}})


def test_cli_flags_become_overrides():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--config", "c.toml", "--store", "h:1", "--model", "/m",
                              "--worker-id", "w", "--metrics-port", "9", "--set",
                              "sampling.n=8"])
    assert cli.overrides_from_args(args) == {
        "store": "h:1", "metrics_port": 9, "worker_id": "w", "engine.model": "/m",
        "sampling.n": "8"}
