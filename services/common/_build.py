"""Builds the C cores next to their sources: the routing codec (`routing_core.c` ->
`_routing_core.so`) and the weight push's CPU pack/checksum (`weight_sync/pack_core.c` ->
`weight_sync/_pack_core.so`).

Run as `python -m services.common._build` (from `make setup`: builds both); their loaders call
`ensure_built(name)` on import, so a fresh checkout or an edited source rebuilds itself.
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

_HERE = Path(__file__).parent
# name -> (C source, shared library)
LIBRARIES = {
    "routing": (_HERE / "routing_core.c", _HERE / "_routing_core.so"),
    "pack": (_HERE / "weight_sync" / "pack_core.c", _HERE / "weight_sync" / "_pack_core.so"),
}
SOURCE, LIBRARY = LIBRARIES["routing"]


def compile_command(source: Path, output: Path) -> list[str]:
    """The compiler command line; x86-64-v2 gives SSE4.2 (CRC-32C) and POPCNT; pthreads for
    r3_check_many."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError(f"no C compiler found (install `cc`/gcc or set CC) to build "
                           f"{source.name}")
    arch = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    return [compiler, "-O3", *arch, "-std=c99", "-pthread", "-shared", "-fPIC", "-o", str(output),
            str(source)]


def sources(source: Path) -> list[Path]:
    """`source` and the files it includes: routing_core.c compiles its sections from
    routing_core/ as one translation unit."""
    parts = source.with_suffix("")
    return [source, *sorted(parts.glob("*.[ch]"))] if parts.is_dir() else [source]


def _is_fresh(source: Path, library: Path) -> bool:
    return library.exists() and library.stat().st_mtime >= max(
        s.stat().st_mtime for s in sources(source)
    )


def _compile(source: Path, library: Path) -> None:
    # Compile to a private name and rename, so a concurrent loader never sees half a file.
    tmp = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    try:
        result = subprocess.run(
            compile_command(source, tmp), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"building {library.name} failed:\n{result.stderr}")
        os.replace(tmp, library)
    finally:
        tmp.unlink(missing_ok=True)


def ensure_built(force: bool = False, name: str = "routing") -> Path:
    """Compile library `name` (see LIBRARIES) if it is missing or older than its source;
    return its path."""
    source, library = LIBRARIES[name]
    if not force and _is_fresh(source, library):
        return library
    with open(source, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not _is_fresh(source, library):  # another process may have built it
            _compile(source, library)
    return library


def main() -> int:
    for name in LIBRARIES:
        path = ensure_built(force="--force" in sys.argv[1:], name=name)
        print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
