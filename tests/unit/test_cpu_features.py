"""AMX tile permission (services/common/cpu_features): asked for in every vLLM process through
the `vllm.general_plugins` entry point, a no-op on CPUs without AMX."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common import cpu_features

HAS_AMX = cpu_features.cpu_has_amx()

AMD_FLAGS = "processor\t: 0\nflags\t\t: fpu vme sse4_2 avx2 avx512f avx512_bf16\n"
INTEL_FLAGS = "processor\t: 0\nflags\t\t: fpu sse4_2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_cpu_has_amx_reads_the_flags_line() -> None:
    assert cpu_features.cpu_has_amx(INTEL_FLAGS)
    assert not cpu_features.cpu_has_amx(AMD_FLAGS)
    assert not cpu_features.cpu_has_amx("model name\t: amx_tile in a name, not a flag\n")


def test_request_is_a_noop_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, object]] = []
    monkeypatch.setattr(cpu_features, "cpu_has_amx", lambda cpuinfo=None: False)
    monkeypatch.setattr(cpu_features, "_arch_prctl", lambda code, arg: calls.append((code, arg)))
    assert cpu_features.request_amx_permission() is False
    assert calls == []  # no syscall on a CPU without AMX


def test_refused_request_returns_false_and_warns(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_features, "cpu_has_amx", lambda cpuinfo=None: True)
    monkeypatch.setattr(cpu_features, "amx_permitted", lambda: False)
    monkeypatch.setattr(cpu_features, "_arch_prctl", lambda code, arg: -1)
    assert cpu_features.request_amx_permission() is False
    assert "refused AMX tile state" in caplog.text


def test_vllm_discovers_the_plugin() -> None:
    plugins_mod = pytest.importorskip("vllm.plugins")
    load_plugins_by_group = plugins_mod.load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins.get("r3flow_cpu_features") is cpu_features.vllm_plugin


PLUGIN_ONLY = """
from services.common import cpu_features as c
before = c.amx_permitted()
c.vllm_plugin()
print(before, c.amx_permitted())
"""


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (no amx_tile flag)")
def test_fresh_process_gets_amx_permission_from_the_plugin_function() -> None:
    """The function the entry point names grants the permission in a fresh interpreter (runs
    where vLLM is not installed too, e.g. a lent GPU host)."""
    out = subprocess.run([sys.executable, "-c", PLUGIN_ONLY], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[-2:] == ["False", "True"]


SPAWNED = """
from services.common import cpu_features as c
before = c.amx_permitted()
from vllm.plugins import load_general_plugins
load_general_plugins()
print(before, c.amx_permitted())
"""


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (no amx_tile flag)")
def test_fresh_process_gets_amx_permission_from_vllms_plugin_loader() -> None:
    pytest.importorskip("vllm")
    """A freshly spawned interpreter starts without the permission (it is not inherited across
    exec) and has it once vLLM loaded its general plugins, as its engine and workers do."""
    out = subprocess.run([sys.executable, "-c", SPAWNED], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[-2:] == ["False", "True"]


@pytest.mark.skipif(HAS_AMX, reason="this CPU has AMX")
def test_fresh_process_without_amx_stays_without_permission() -> None:
    out = subprocess.run([sys.executable, "-c", SPAWNED], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[-2:] == ["False", "False"]
