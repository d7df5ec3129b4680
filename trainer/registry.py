"""The trainer's backends by name: where each declares its config sections and its engine.

The neutral core (trainer.config, the step, the loop) imports no backend package. It names them
here, as dotted paths, and loads them by name: a backend's config module declares the sections
it adds to TrainerConfig (`SECTIONS`: section name -> pydantic model) and the checks it runs on
a whole config (`check_trainer(cfg)`); `engine` is its TrainBackend class (trainer.protocol),
which only trainer.backend builds. Adding a backend is one row here plus its package.

Every backend's sections are part of every TrainerConfig, whichever backend is selected: a
section of another backend is validated (its typos are errors) and left unused, as before the
sections moved out of trainer.config.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import CoreSchema


@dataclass(frozen=True)
class BackendEntry:
    """Where one backend lives: its config module and its engine (`module:Class`)."""

    config: str
    engine: str


BACKENDS: dict[str, BackendEntry] = {
    "megatron": BackendEntry("trainer.megatron.config", "trainer.megatron.engine:MegatronBackend"),
    "hf": BackendEntry("trainer.hf.config", "trainer.hf.engine:HFBackend"),
}


def config_module(backend: str) -> ModuleType:
    """The config module of `backend` (it declares SECTIONS and check_trainer)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r} (known: {sorted(BACKENDS)})")
    return importlib.import_module(BACKENDS[backend].config)


def check_dotted(path: str, field: str) -> tuple[str, str]:
    """(module, attribute) of a `module.path:attr` string; ValueError naming `field` otherwise."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        where = f"{field}: " if field else ""
        raise ValueError(f"{where}{path!r} is not of the form 'module.path:attribute'")
    return module, attr


def load_attr(path: str, field: str) -> Any:
    """The object a `module.path:attr` string names; ValueError naming `field` otherwise."""
    module, attr = check_dotted(path, field)
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{field}: cannot import {module!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{field}: module {module!r} has no attribute {attr!r}")
        found = getattr(found, part)
    return found


def engine_class(backend: str) -> type:
    """The TrainBackend class of `backend` (imports its runtime: torch, megatron or HF)."""
    config_module(backend)  # the unknown-backend error
    return load_attr(BACKENDS[backend].engine, "backend")  # type: ignore[no-any-return]


def section_type(name: str) -> type:
    """The pydantic model of the TrainerConfig section `name`: the one backend declaring it."""
    owners = [(b, config_module(b).SECTIONS[name]) for b in BACKENDS
              if name in config_module(b).SECTIONS]
    if len(owners) != 1:
        raise TypeError(f"TrainerConfig section {name!r}: declared by {len(owners)} backends "
                        f"({[b for b, _ in owners]}), expected exactly one")
    return owners[0][1]  # type: ignore[no-any-return]


def check_backend(cfg: Any) -> None:
    """The checks the selected backend runs on a whole TrainerConfig (ValueError naming a field)."""
    config_module(cfg.backend).check_trainer(cfg)


class Section:
    """`Annotated[Any, Section("model")]`: a TrainerConfig field validated by the model the
    backend declaring `name` registered (same schema, same error locations as a plain field)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler
                                     ) -> CoreSchema:
        return handler.generate_schema(section_type(self.name))

    def default(self) -> Any:
        """A fresh section with every default (the field's default_factory)."""
        return section_type(self.name)()
