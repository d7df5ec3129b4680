"""The C cores are built at install time (`make setup`, the images: `python -m
services.common._build`); loaders only load (`_build.library_path`) and name the build command
when a library is missing or built from other sources."""

from __future__ import annotations

import os
import shutil

import pytest

from services.common import _build


@pytest.fixture
def tiny_library(tmp_path, monkeypatch):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler")
    source = tmp_path / "tiny.c"
    source.write_text("int tiny(void) { return 7; }\n")
    monkeypatch.setitem(_build.LIBRARIES, "tiny", (source, tmp_path / "_tiny.so"))
    return source, tmp_path / "_tiny.so"


def test_missing_library_names_the_build_command(tiny_library):
    with pytest.raises(_build.LibraryNotBuilt, match=r"not built: run `make setup` or "
                                                     r"`python -m services.common._build`"):
        _build.library_path("tiny")


def test_built_library_loads_until_its_source_changes(tiny_library):
    source, library = tiny_library
    assert _build.ensure_built(name="tiny") == library
    assert _build.library_path("tiny") == library
    os.utime(source, (1, 1))  # a copy that resets file times (pip, docker COPY) stays valid
    os.utime(library, (0, 0))
    assert _build.library_path("tiny") == library
    source.write_text("int tiny(void) { return 8; }\n")
    with pytest.raises(_build.LibraryNotBuilt, match=r"older than its sources \(tiny.c\): run "
                                                     r"`make setup`"):
        _build.library_path("tiny")
    _build.ensure_built(name="tiny")
    assert _build.library_path("tiny") == library


def test_routing_core_sections_count_as_its_sources():
    source, _ = _build.LIBRARIES["routing"]
    names = [p.name for p in _build.sources(source)]
    assert names[0] == "routing_core.c" and "core.h" in names and "encoder.c" in names
    for part in names[1:]:  # every section is compiled in: routing_core.c includes it
        assert part == "core.h" or f'#include "routing_core/{part}"' in source.read_text()
