"""Weight pushes copied straight into a GPU engine's parameters (issue 57 item 2).

vLLM's `reload_weights` (checkpoint format) rebuilds each layer on the side, runs every tensor
through the model's `load_weights` name matching and the layer's weight loaders, processes the
layer and copies it back: on the H200 that was most of a 0.73 B push (0.46 s of 0.51). For an
unquantized engine on a GPU the kernel format is the checkpoint's rows placed into fused
parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, expert e's gate/up/down -> rows of
w13[e] / w2[e], the vocabulary padded), so a push can be `copy_` into fixed views of the
parameters instead.

`DirectMap.build` makes that map once from the push's names and shapes and the engine's
parameters; it is a hypothesis until `verify` has compared every view with the tensor vLLM's own
reload placed there (the first push goes through the reload), so a backend that permutes or
quantizes the weights (FlashInfer's [w3; w1], fp8, a CPU prepack) keeps the reload: the map is
refused, with the reason, and never used.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

# checkpoint projection -> (fused parameter, the projections it stacks, in row order)
_STACKED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
    "up_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}
_LINEAR = re.compile(r"^(?P<parent>.*)\.(?P<proj>[a-z_]+_proj)\.weight$")
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)"
                     r"\.weight$")


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lands: rows [start, start + rows) of `param` (of its
    `expert`-th matrix when set)."""

    param: str
    expert: int | None
    start: int
    rows: int


class MapRefused(ValueError):
    """The push cannot be copied straight into the parameters (the reason names the tensor)."""


def _expert_param(params: Mapping[str, torch.Tensor], prefix: str, suffix: str) -> str:
    found = [n for n in params if n.startswith(prefix + ".") and n.endswith(suffix)]
    if len(found) != 1:
        raise MapRefused(f"{prefix}: {len(found)} parameters named *{suffix} (expected one)")
    return found[0]


def _slot(name: str, shapes: Mapping[str, torch.Size],
          params: Mapping[str, torch.Tensor]) -> Slot:
    rows = shapes[name][0] if len(shapes[name]) else 1
    if name in params:
        return Slot(name, None, 0, rows)
    if (m := _EXPERT.match(name)) is not None:
        if m["kind"] == "down_proj":
            return Slot(_expert_param(params, m["prefix"], "w2_weight"), int(m["e"]), 0, rows)
        gate = f"{m['prefix']}.{m['e']}.gate_proj.weight"
        start = 0 if m["kind"] == "gate_proj" else shapes[gate][0] if gate in shapes else -1
        if start < 0:
            raise MapRefused(f"{name}: its gate_proj is not in the push")
        return Slot(_expert_param(params, m["prefix"], "w13_weight"), int(m["e"]), start, rows)
    if (m := _LINEAR.match(name)) is not None and m["proj"] in _STACKED:
        fused, order = _STACKED[m["proj"]]
        start = 0
        for proj in order[:order.index(m["proj"])]:
            sibling = f"{m['parent']}.{proj}.weight"
            if sibling not in shapes:
                raise MapRefused(f"{name}: {sibling} is not in the push")
            start += shapes[sibling][0]
        return Slot(f"{m['parent']}.{fused}.weight", None, start, rows)
    raise MapRefused(f"{name}: no engine parameter of that name")


class DirectMap:
    """Checkpoint name -> a fixed view of the engine parameter its rows land in."""

    def __init__(self, views: dict[str, torch.Tensor]) -> None:
        self.views = views

    @classmethod
    def build(cls, params: Mapping[str, torch.Tensor],
              shapes: Mapping[str, tuple[torch.Size, torch.dtype]]) -> DirectMap:
        """The views for a push of `shapes` (name -> (shape, dtype)) into `params` (the
        engine's named parameters); raises MapRefused naming the first tensor that does not
        land as a plain row block, or a parameter the push would leave partly unwritten
        (beyond the vocabulary's padding rows)."""
        only = {n: torch.Size(s) for n, (s, _) in shapes.items()}
        views: dict[str, torch.Tensor] = {}
        covered: dict[str, int] = {}
        for name, (shape, dtype) in shapes.items():
            slot = _slot(name, only, params)
            p = params.get(slot.param)
            if p is None or (slot.expert is not None and not 0 <= slot.expert < len(p)):
                raise MapRefused(f"{name}: the engine has no {slot.param}"
                                 f"{'' if slot.expert is None else f'[{slot.expert}]'}")
            if p.dtype != dtype:
                raise MapRefused(f"{name}: the engine holds {slot.param} as {p.dtype}, the "
                                 f"push sends {dtype}")
            whole = p.data if slot.expert is None else p.data[slot.expert]
            fits = not whole.dim() or slot.start + slot.rows <= whole.shape[0]
            view = whole.narrow(0, slot.start, slot.rows) if whole.dim() and fits else whole
            if not fits or view.shape != torch.Size(shape):
                raise MapRefused(f"{name}: {tuple(shape)} does not fit rows {slot.start}.. of "
                                 f"{slot.param} {tuple(p.shape)}")
            views[name] = view
            covered[slot.param] = covered.get(slot.param, 0) + view.numel()
        for pname, p in params.items():
            got = covered.get(pname, 0)
            padded = pname in views and p.dim() == 2 and got == views[pname].numel()  # vocab rows
            if got != p.numel() and not padded:
                raise MapRefused(f"{pname}: the push writes {got} of its {p.numel()} elements")
        return cls(views)

    def verify(self, received: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Raise MapRefused unless every view holds exactly the tensor received for it (called
        after vLLM's own reload placed those tensors)."""
        seen = set()
        for name, t in received:
            view = self.views.get(name)
            if view is None or not torch.equal(view, t.to(view.device)):
                raise MapRefused(f"{name}: vLLM's reload placed it elsewhere or changed it "
                                 "(a permuting or quantizing kernel format)")
            seen.add(name)
        if missing := set(self.views) - seen:
            raise MapRefused(f"{sorted(missing)[0]}: mapped but not in the verified push")

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each (name, tensor) into its view as it comes; returns how many. A name the map
        does not hold raises MapRefused (the push's layout changed: rebuild)."""
        count = 0
        for name, t in named:
            view = self.views.get(name)
            if view is None or view.shape != t.shape:
                raise MapRefused(f"{name}: not in the direct map")
            view.copy_(t, non_blocking=True)
            count += 1
        return count
