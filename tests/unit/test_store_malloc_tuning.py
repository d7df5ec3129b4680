"""The store's glibc malloc settings (services/store/malloc_tuning.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

from services.store.config import StoreConfig
from services.store.malloc_tuning import keep_freed_memory


def test_zero_keeps_the_defaults():
    assert keep_freed_memory(0) is False


def test_default_config_keeps_freed_memory():
    assert StoreConfig().malloc_keep_bytes == 256 << 20
    with pytest.raises(ValueError, match="malloc_keep_bytes"):
        StoreConfig(malloc_keep_bytes=-1)


@pytest.mark.skipif(not ctypes.util.find_library("c") or sys.platform != "linux",
                    reason="glibc only")
def test_applied_in_a_fresh_process():
    # in a child: mallopt settings are process-wide and would outlive this test
    code = ("from services.store.malloc_tuning import keep_freed_memory as k; "
            "import sys; sys.exit(0 if k(64 << 20) else 3)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
