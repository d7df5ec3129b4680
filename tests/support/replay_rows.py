"""How many bytes of replayed int64 router ids are alive at once (issue 54's bounded-memory
checks of the trainer backends)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

import torch


class RowsAlive:
    """Forward hooks on `modules` (the routers) keeping a weak reference to every id tensor
    `ids_of(module)` names at each forward (a view counts as its base, the tensor it slices);
    `peak`: the most bytes of them alive at once, `seen`: forwards that replayed ids."""

    def __init__(self, modules: Sequence[torch.nn.Module],
                 ids_of: Callable[[torch.nn.Module], Iterable[torch.Tensor | None]]) -> None:
        self._ids_of = ids_of
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = self.seen = 0
        self._handles = [m.register_forward_hook(self._hook) for m in modules]

    def _hook(self, module, *_) -> None:
        for t in self._ids_of(module):
            if t is None:
                continue
            base = t if t._base is None else t._base
            self._refs.setdefault(id(base), (weakref.ref(base), base.nbytes))
            self.seen += 1
        alive = sum(n for ref, n in self._refs.values() if ref() is not None)
        self.peak = max(self.peak, alive)

    def __enter__(self) -> RowsAlive:
        return self

    def __exit__(self, *_) -> None:
        for h in self._handles:
            h.remove()
