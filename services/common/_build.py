"""Builds the C cores next to their sources, at install time: the routing codec (`routing_core.c`,
which compiles its sections from routing_core/ as one unit -> `_routing_core.so`) and the weight
push's CPU pack/checksum (`weight_sync/pack_core.c` -> `weight_sync/_pack_core.so`).

`python -m services.common._build` builds what is missing or stale; `make setup` and the images
(docker/*.Dockerfile) run it. The loaders only load (`library_path`): a library that is missing or
built from other sources raises `LibraryNotBuilt` saying how to build it. Freshness is the
SHA-256 of the sources, written beside the library (`<library>.sha256`) when it is built, so
copies that reset file times (git checkout, pip install, docker COPY) keep a valid build valid.
An exclusive lock on the source file keeps concurrent builds from compiling at once.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
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
BUILD_HINT = "run `make setup` or `python -m services.common._build`"


class LibraryNotBuilt(RuntimeError):
    """A C core is missing or older than its sources (the loaders do not compile)."""


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


def source_digest(source: Path) -> str:
    h = hashlib.sha256()
    for path in sources(source):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _stamp(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _is_fresh(source: Path, library: Path) -> bool:
    stamp = _stamp(library)
    return (library.exists() and stamp.exists()
            and stamp.read_text().strip() == source_digest(source))


def _compile(source: Path, library: Path) -> None:
    # Compile to a private name and rename, so a concurrent loader never sees half a file.
    tmp = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    digest = source_digest(source)
    try:
        result = subprocess.run(
            compile_command(source, tmp), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"building {library.name} failed:\n{result.stderr}")
        os.replace(tmp, library)
        stamp_tmp = tmp.with_name(tmp.name + ".sha256")
        stamp_tmp.write_text(digest + "\n")
        os.replace(stamp_tmp, _stamp(library))
    finally:
        tmp.unlink(missing_ok=True)


def ensure_built(force: bool = False, name: str = "routing") -> Path:
    """Compile library `name` (see LIBRARIES) if it is missing or older than its sources;
    return its path. The build step: loaders call `library_path`."""
    source, library = LIBRARIES[name]
    if not force and _is_fresh(source, library):
        return library
    with open(source, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not _is_fresh(source, library):  # another process may have built it
            _compile(source, library)
    return library


def library_path(name: str = "routing") -> Path:
    """The built library `name`; LibraryNotBuilt if it is missing or stale (never compiles)."""
    source, library = LIBRARIES[name]
    if not library.exists():
        raise LibraryNotBuilt(f"{library} is not built: {BUILD_HINT}")
    if not _is_fresh(source, library):
        raise LibraryNotBuilt(f"{library} is older than its sources ({source.name}): "
                              f"{BUILD_HINT}")
    return library


def main() -> int:
    args = sys.argv[1:]
    for name in LIBRARIES:
        if "--check" in args:  # an installed copy (docker images): every library loads
            path = library_path(name)
            ctypes.CDLL(str(path))
            print(f"ok {path}")
            continue
        fresh = _is_fresh(*LIBRARIES[name]) and "--force" not in args
        path = ensure_built(force="--force" in args, name=name)
        print(f"{'up to date' if fresh else 'built'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
