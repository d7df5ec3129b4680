"""The chart sizes Redis, the pull limit (PullChunks' largest part) and pod memory for the longest trajectory at the
codec's worst case (issue 54): its figures (templates/_sizing.tpl) equal
services/common/routing_size.py's, the store defaults it assumes are StoreConfig's, and a 128k
release sized for it renders (the refusals are in test_refusals.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import API_VERSIONS, CHART, run_helm

from services.common import routing_size
from services.store.config import StoreConfig

PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: sizing-probe
data:
  bits: {{ include "r3flow.floorBits" (dict "e" .Values.probe.e "k" .Values.probe.k) | quote }}
  longest: {{ include "r3flow.longestTrajectory" . | quote }}
  defaults: {{ include "r3flow.storeDefaults" . | quote }}
"""


def _probe(helm: Path, tmp_path: Path, *args: str) -> dict:
    chart = tmp_path / "r3flow"
    if not chart.exists():
        shutil.copytree(CHART, chart)
        (chart / "templates" / "sizing-probe.yaml").write_text(PROBE)
        schema = json.loads((chart / "values.schema.json").read_text())
        schema["properties"]["probe"] = {"type": "object"}  # the probe's own value
        (chart / "values.schema.json").write_text(json.dumps(schema))
    proc = run_helm(helm, "template", "x", str(chart), *API_VERSIONS, *args,
                    "--show-only", "templates/sizing-probe.yaml")
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(proc.stdout)["data"]
    return {k: yaml.safe_load(v) for k, v in data.items()}


# (MoE layers, top-k, experts): Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B, the codec's widest
LAYOUTS = [(48, 8, 128), (58, 8, 256), (32, 2, 8), (4, 16, 1024)]


@pytest.mark.parametrize(("layers", "topk", "experts"), LAYOUTS)
def test_chart_figures_are_the_codec_bounds(helm, tmp_path, layers, topk, experts):
    tokens, n = 131_072, 8
    models = json.dumps([{"name": "m", "num_experts": experts, "top_k": topk,
                          "moe_layers": layers}])
    got = _probe(helm, tmp_path, "--set-json", f"store.models={models}",
                 "--set-json", f'probe={{"e": {experts}, "k": {topk}}}',
                 "--set", f"rollout.config.engine.max_model_len={tokens}")
    floor = routing_size.floor_bits_per_row(experts, topk)
    assert floor <= got["bits"] <= floor + 2**-19  # an upper bound, within 2^-19 bit
    want = routing_size.max_trajectory_bytes(tokens, layers, topk, experts)
    slack = tokens * layers * 2**-19 / 8 + 1  # from the bits' rounding up
    long = got["longest"]
    assert want <= long["trajectory"] <= want + slack, (long, want)
    assert (long["tokens"], long["group"]) == (tokens, n)
    assert long["groupBytes"] == n * long["trajectory"]
    want = routing_size.max_part_bytes(tokens, layers, topk, experts)
    assert want <= long["partBytes"] <= want + slack, (long, want)
    assert long["heads"] == n * (tokens * routing_size.TOKEN_BYTES
                                 + routing_size.TRAJECTORY_BYTES)
    ids = tokens * layers * topk
    assert long["decoded"] == n * ids * routing_size.ids_dtype_bytes(experts)
    assert long["capture"] == 4 * ids


def test_store_defaults_the_chart_assumes_are_the_store_s(helm, tmp_path):
    defaults = _probe(helm, tmp_path, "--set-json", 'probe={"e": 8, "k": 2}')["defaults"]
    assert defaults == {k: StoreConfig.model_fields[k].default for k in defaults}


def test_the_worst_registered_layout_is_sized_for(helm, tmp_path):
    """Two registered models: the larger per-token bound (DeepSeek-V3's 58 layers) wins."""
    models = json.dumps([{"name": "q", "num_experts": 128, "top_k": 8, "moe_layers": 48},
                         {"name": "d", "num_experts": 256, "top_k": 8, "moe_layers": 58}])
    long = _probe(helm, tmp_path, "--set-json", f"store.models={models}",
                  "--set-json", 'probe={"e": 8, "k": 2}')["longest"]
    assert long["trajectory"] >= routing_size.max_trajectory_bytes(8192, 58, 8, 256)


def test_a_release_sized_for_128k_renders(helm, tmp_path):
    """128k trajectories in groups of 8 with the default Redis, store and pods; the Redis
    check's group term is what refuses test_refusals' max_unacked_tokens 61.6M at 128k: the
    same value renders at 8k."""
    values = tmp_path / "long.yaml"
    values.write_text("rollout:\n  config:\n    engine: {max_model_len: 131072}\n"
                      "trainer:\n  enabled: true\n")
    proc = run_helm(helm, "template", "x", str(CHART), *API_VERSIONS, "-f", str(values))
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_helm(helm, "template", "x", str(CHART), *API_VERSIONS,
                    "--set", "store.config.max_unacked_tokens=61600000")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(("spill", "renders"), [(0, True), (64 << 20, True), (1 << 30, False)])
def test_the_rollout_pod_is_sized_with_its_routing_spill(helm, tmp_path, spill, renders):
    """The rollout pod holds a group's encoded routing up to spill_routing_bytes (at most the
    whole group), then one trajectory at a time (services/rollout/spill.py): a 700Mi pod at
    128k fits spilling at 0 or 64 MiB, not at 1 GiB (the 8 x 128k group, ~265 MB, in memory)."""
    values = tmp_path / "spill.yaml"
    values.write_text("rollout:\n  resources:\n    limits: {memory: 700Mi}\n  config:\n"
                      f"    spill_routing_bytes: {spill}\n    engine: {{max_model_len: 131072}}\n"
                      "    sampling: {n: 8}\n")
    proc = run_helm(helm, "template", "x", str(CHART), *API_VERSIONS, "-f", str(values))
    if renders:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0
        assert "rollout.resources.limits.memory" in proc.stderr
        assert "rollout.config.spill_routing_bytes" in proc.stderr


@pytest.mark.parametrize(("micro_batch", "renders"), [(1, True), (8, False)])
def test_the_trainer_rank_is_sized_for_one_micro_batch_decoded(helm, tmp_path, micro_batch,
                                                               renders):
    """Routing stays encoded after intake and each micro-batch decodes its own: a 1200Mi rank
    at 8 x 128k fits micro-batches of 1 sample (the group's decoded ids, 403 MB, no longer
    counted), not of 8."""
    values = tmp_path / "rank.yaml"
    values.write_text("rollout:\n  config:\n    engine: {max_model_len: 131072}\n"
                      "    sampling: {n: 8}\ntrainer:\n  enabled: true\n  workers:\n"
                      "    gpus: 1\n    resources:\n      limits: {memory: 1200Mi}\n"
                      f"  config:\n    data:\n      micro_batch_size: {micro_batch}\n")
    proc = run_helm(helm, "template", "x", str(CHART), *API_VERSIONS, "-f", str(values))
    if renders:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0
        assert "trainer.config.data.micro_batch_size 8 + 2" in proc.stderr, proc.stderr[-2000:]
