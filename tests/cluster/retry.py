"""The kill and KubeRay's retry of a RayJob (rayjob.py), and what the test requires of both:

- attempt 1: a RayCluster (head + 2 worker pods) from KubeRay's commands, the submitter's
  `ray job submit`; the trainer places its 2 ranks one per worker pod, rendezvous at rank 0's
  pod address; after the first step every process of rank 1's pod is SIGKILLed mid-step: the job
  fails (`ray job status` FAILED), its log naming the dead rank and its node
  (RankDiedError: trainer rank 1 (node <pod ip>) died ...);
- the retry: the whole RayCluster deleted (every pod, head included, stopped by pid), a new one
  created at new addresses (none of attempt 1's, head included; its head Service resolves to
  the new head), the job submitted again (a new submission id, the same checkpoints PVC): it
  resumes from the last complete checkpoint attempt 1 left (`latest`) and succeeds;
- the trainer's ledger holds steps 1..N without a gap, every trajectory id once; no
  (epoch, prompt) trained twice (each rollout pod reads its own shard of the prompts);
- every push of the retry goes from rank 0's pod address and the configured port to both
  rollout pods; the per-tensor digests of its last push, as each rollout pod loaded it, equal
  rank 0's export.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import kube
from cluster import GROUP_SIZE, Cluster, eventually
from rayjob import RayJobRun

from trainer.loop.ledger import read_trained_ids, read_trained_prompts

PLACED = r"2 rank\(s\) on nodes \[.*?\]; MASTER_ADDR=[0-9.]+:\d+"
ROLLOUT_DIGESTS = ("vol", "tmp", "weight_digests.json")  # rollout weight_digests_file (/tmp)


@dataclass
class Placement:
    nodes: list[str]
    master: str


def placement(text: str, workers: list[kube.Pod]) -> Placement:
    """The trainer's placement line: 2 ranks, one on each worker pod, rank 0's pod the
    rendezvous (MASTER_ADDR), never loopback."""
    m = re.search(PLACED, text)
    assert m, text[-4000:]
    nodes = re.findall(r"'([0-9.]+)'", m[0])
    master = re.search(r"MASTER_ADDR=([0-9.]+)", m[0])[1]  # type: ignore[index]
    assert len(set(nodes)) == 2 and set(nodes) <= {w.ip for w in workers}, (m[0], workers)
    assert master == nodes[0] and master != "127.0.0.1", m[0]
    return Placement(nodes, master)


def train_log(run: RayJobRun) -> list[dict]:
    path = run.run_dir() / "train_log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def killed_attempt(run: RayJobRun) -> dict:
    """Attempt 1 up, the job submitted, rank 1's pod SIGKILLed after the first step: the job
    fails naming rank 1 and its node."""
    c, t0 = run.c, time.monotonic()
    run.attempt()
    c.rollouts_ready()
    sub = run.submit()
    placed = placement(c.wait_log(run.submitter, PLACED, 400, run.log_name), run.workers)
    assert eventually(lambda: len(train_log(run)) >= 1, 400), run.log()[-4000:]
    # ... and once both rollout pods loaded step 1's weights: the kill lands in step 2 (its pull
    # or its training), not in a push (a push cut off mid-way is another failure: see
    # docs/cluster-test.md)
    version = int(train_log(run)[0]["policy_version"])
    for r in c.by_name("r3flow-rollout"):
        c.wait_log(r, rf"policy version {version}\b", 300)
    victim = next(w for w in run.workers if w.ip == placed.nodes[1])
    assert c.box.kill_pod(c.ns(victim)), "no process in the victim pod"
    t_kill = time.monotonic()
    status = run.follow(sub, 300)
    failed_log = run.log()
    assert status == "FAILED", (status, failed_log[-4000:])
    assert re.search(rf"RankDiedError: trainer rank 1 \(node {re.escape(victim.ip)}\) died",
                     failed_log), failed_log[-4000:]
    assert re.search(rf"Job '{run.submission_id}' failed", failed_log), failed_log[-4000:]
    return {"nodes": placed.nodes, "killed": victim.name, "status": status,
            "failed_in_s": round(time.monotonic() - t_kill, 1),
            "up_to_failed_s": round(time.monotonic() - t0, 1)}


def latest_checkpoint(run: RayJobRun) -> int:
    """The step of the newest complete checkpoint (`<run_dir>/checkpoints/latest`)."""
    name = (run.run_dir() / "checkpoints" / "latest").read_text().strip()
    return int(name.removeprefix("step_"))


def retried_attempt(run: RayJobRun) -> dict:
    """KubeRay's retry: attempt 1's RayCluster deleted, a new one at new addresses, the job
    submitted again: it resumes from the last checkpoint and succeeds."""
    c, t0 = run.c, time.monotonic()
    old = {p.name: p.ip for p in run.pods}
    run.delete()
    gone = [n for n in old if n in c.box.pods]
    assert not gone, f"pods of the failed attempt still exist: {gone}"
    resume_step = latest_checkpoint(run)  # read with every trainer process gone
    t_deleted = time.monotonic()
    run.attempt()
    t_up = time.monotonic()
    new = {p.name: p.ip for p in run.pods}
    assert not set(new.values()) & set(old.values()), (old, new)
    assert not set(new) & set(old), (old, new)
    fq = f"{run.head_svc}.r3flow.svc.cluster.local"
    assert c.resolve(run.submitter, fq) == run.head.ip, (fq, run.head.ip)
    status = run.follow(run.submit(), 600)
    log = run.log()
    assert status == "SUCCEEDED", (status, log[-4000:])
    resumed = re.search(r"resumed at step (\d+)", log)
    assert resumed and int(resumed[1]) == resume_step, (resume_step, log[-4000:])
    placed = placement(log, run.workers)
    return {"old_ips": old, "new_ips": new, "status": status, "resumed_at": resume_step,
            "nodes": placed.nodes, "master": placed.master,
            "deleted_s": round(t_deleted - t0, 1), "ray_up_s": round(t_up - t_deleted, 1),
            "retry_s": round(time.monotonic() - t0, 1)}


def check_ledger(run: RayJobRun, resumed: bool = True) -> list[str]:
    """Nothing trained twice, nothing lost: steps 1..N without a gap (run.steps counts the
    steps of each submission: N = resume point + run.steps), each trajectory id once."""
    path = run.run_dir() / "trained_ids.jsonl"
    ledger = read_trained_ids(path)
    steps = run.train_config()["run"]["steps"]
    assert sorted(ledger) == list(range(1, len(ledger) + 1)), ledger
    assert len(ledger) >= int(resumed) + steps, ledger
    ids = [i for step in ledger.values() for i in step]
    assert len(ids) == len(set(ids)) and len(ids) >= len(ledger), ledger
    return ids


def check_prompts(c: Cluster, run: RayJobRun, ids: list[str]) -> dict[str, list]:
    """Every (epoch, prompt) trained on came from one group of one rollout pod, never two
    (docs/rollout-data.md); returns rollout pod -> its (epoch, prompt)s."""
    sources = [s for step in read_trained_prompts(run.run_dir() / "trained_ids.jsonl").values()
               for s in step]
    rollouts = {r.name for r in c.by_name("r3flow-rollout")}
    assert {w for w, _, _ in sources} <= rollouts, sources
    prompts = [(e, p) for _, e, p in sources]
    assert len(sources) * GROUP_SIZE == len(ids) and len(set(prompts)) == len(prompts), sources
    out: dict[str, list] = {}
    for worker, epoch, prompt in sources:
        out.setdefault(worker, []).append((epoch, prompt))
    return {k: sorted(v) for k, v in out.items()}


def check_pushes(c: Cluster, run: RayJobRun, master: str) -> dict:
    """The retry's pushes: from rank 0's pod address and port 29600 to both rollout pods; the
    digests of the last one on both pods equal rank 0's export."""
    pushes = re.findall(r"pushed v(\d+) from ([0-9.]+):(\d+) to (\d+) worker", run.log())
    assert pushes and all(ip == master and port == "29600" for _, ip, port, _ in pushes), pushes
    last = int(pushes[-1][0])
    rollouts = c.by_name("r3flow-rollout")
    assert pushes[-1][3] == str(len(rollouts)), (pushes, {r.name: c.log(r)[-2500:]
                                                          for r in rollouts})
    for r in rollouts:
        c.wait_log(r, rf"policy version {last}\b", 60)
    want = json.loads((run.run_dir() / "export-digests" / f"v{last}.json").read_text())
    assert want["version"] == last and want["digests"], want.get("version")
    for r in rollouts:
        got = json.loads(c.ns(r).root.joinpath(*ROLLOUT_DIGESTS).read_text())
        assert got["version"] == last, (r.name, got["version"])
        assert set(got["digests"]) == set(want["digests"]), r.name
        bad = sorted(n for n in want["digests"] if got["digests"][n] != want["digests"][n])
        assert not bad, (r.name, bad[:5])
    return {"pushes": pushes, "digests": len(want["digests"])}


def kill_and_retry(run: RayJobRun, between=None) -> dict:
    """The whole scenario of one RayJob (`between()` runs after the failure, on attempt 1's
    cluster); its trained ids recorded for the accounting."""
    t0 = time.monotonic()
    shutdown_finished(run.c)
    try:
        first = killed_attempt(run)
        if between:
            between()
        second = retried_attempt(run)
    except BaseException:
        run.delete()  # a failed scenario leaves nothing running for the next one (logs stay)
        raise
    ids = check_ledger(run)
    run.c.trained_ids[run.name] = ids
    run.c.finished.append(run)
    out = {"job": run.name, "attempt1": first, "attempt2": second,
           **check_pushes(run.c, run, second["master"]),
           "ledger_steps": len(read_trained_ids(run.run_dir() / "trained_ids.jsonl")),
           "trained_ids": len(ids), "prompts_by_pod": check_prompts(run.c, run, ids)}
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def auth_refused(run: RayJobRun) -> None:
    """Ray token auth (the RayJob's authOptions): a submission without the token is refused."""
    code = run.submit_status(None)
    assert code in (401, 403), f"dashboard accepted a job without the token: HTTP {code}"


def shutdown_finished(c: Cluster) -> None:
    """shutdownAfterJobFinishes: the RayClusters of jobs that finished are deleted (kept until
    the next job starts: the last one's head asks the store for the accounting)."""
    while c.finished:
        c.finished.pop().delete()
