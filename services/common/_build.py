"""Builds the routing codec's C core into `_routing_core.so` next to its source.

Run as `python -m services.common._build` (from `make setup`); `routing.py` also calls
`ensure_built()` on import, so a fresh checkout or an edited `routing_core.c` rebuilds itself.
An exclusive lock on the source file keeps concurrent processes from compiling at once.
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("routing_core.c")
LIBRARY = Path(__file__).with_name("_routing_core.so")


def compile_command(source: Path, output: Path) -> list[str]:
    """The compiler command line; x86-64-v2 gives SSE4.2 (CRC-32C) and POPCNT; pthreads for
    r3_check_many."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install `cc`/gcc or set CC) to build the codec")
    arch = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    return [compiler, "-O3", *arch, "-std=c99", "-pthread", "-shared", "-fPIC", "-o", str(output),
            str(source)]


def _is_fresh() -> bool:
    return LIBRARY.exists() and LIBRARY.stat().st_mtime >= SOURCE.stat().st_mtime


def _compile() -> None:
    # Compile to a private name and rename, so a concurrent loader never sees half a file.
    tmp = LIBRARY.with_name(f"{LIBRARY.name}.{os.getpid()}.tmp")
    try:
        result = subprocess.run(
            compile_command(SOURCE, tmp), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"building {LIBRARY.name} failed:\n{result.stderr}")
        os.replace(tmp, LIBRARY)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_built(force: bool = False) -> Path:
    """Compile the core if the library is missing or older than its source; return its path."""
    if not force and _is_fresh():
        return LIBRARY
    with open(SOURCE, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not _is_fresh():  # another process may have built it while we waited
            _compile()
    return LIBRARY


def main() -> int:
    path = ensure_built(force="--force" in sys.argv[1:])
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
