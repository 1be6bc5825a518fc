"""``do_flatten``: one param group's parameters moved into flat buffers, with gradient and state
buffers of the same layout.

The parameters move with the core's :func:`functional_bagua.flatten_parameters` (``p.data``
becomes a view of one buffer per (device, dtype); the ``Parameter`` objects stay the same). A
:class:`FlattenedGroup` adds, in the same :class:`~functional_bagua.FlatLayout`, a gradient buffer
and one buffer per state key (``optimizer.state[p]["exp_avg"]`` ...), each made when first needed
and holding whatever the parameters had then; a parameter without a gradient or state leaves its
slot unused. A run of parameters that sits at its slots (:meth:`FlattenedGroup.home`) keeps its
gradients and state there, so that a fused step finds them back to back.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import NamedTuple, Optional, Union

import torch

from functional_bagua.compat.runs import fusable_on_its_device
from functional_bagua.flat import Segment, flatten_parameters


def flattenable(params: list) -> list:
    """The parameters worth flattening, in group order: those that can have a gradient, hold
    elements, are not 0-dim (a 0-dim parameter's state could not be told apart from a scalar such
    as ``step``), can be fused on their device
    (:func:`~functional_bagua.compat.runs.fusable_on_its_device`: a large or half-precision CPU
    parameter is stepped on its own, so a flat copy of it would only cost memory), and share their
    (device, dtype) with another such parameter (one alone has nothing to be fused with)."""
    candidates = [
        p
        for p in params
        if p.requires_grad
        and p.dim() > 0
        and p.numel() > 0
        and p.layout == torch.strided
        and p.is_contiguous()
        and fusable_on_its_device(p)
    ]
    kinds = Counter((p.device, p.dtype) for p in candidates)
    return [p for p in candidates if kinds[(p.device, p.dtype)] > 1]


class Home(NamedTuple):
    """Where a run of parameters lives in a :class:`FlattenedGroup`: elements ``start:end`` of the
    buffers of group ``key``. Its gradients and state tensors go to the same elements."""

    group: "FlattenedGroup"
    key: str
    start: int
    end: int

    def grads(self) -> torch.Tensor:
        """The run's slice of the group's gradient buffer (made, zeroed, when first needed)."""
        return self.group.buffer(self.key, "grad", self.group.layout.groups[self.key].dtype)[self.start : self.end]

    def state(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The run's slice of the buffer of state ``name``, of ``like``'s dtype and device."""
        return self.group.buffer(self.key, ("state", name), like.dtype, like.device)[self.start : self.end]


class FlattenedGroup:
    """One param group's :func:`flattenable` parameters, moved into flat buffers (module docstring).

    Args:
        params: the group's parameters (``group["params"]``), in group order.
        state: the optimizer's state; gradients and parameter-shaped state tensors the parameters
            have already move into the new buffers.
    """

    def __init__(self, params: list, state: dict) -> None:
        self.params = flattenable(params)
        self.layout = flatten_parameters(self.params)[0]  # the parameters view the buffers, which they keep alive
        self._pointers = list(map(torch.Tensor.data_ptr, self.params))
        self._segments: dict[int, tuple[str, Segment, int]] = {}  # id(p) -> (group key, segment, p's pointer)
        for key, group in self.layout.groups.items():
            for segment in group.segments:
                i = int(segment.name)  # the leaf names of a list are its indices
                self._segments[id(self.params[i])] = (key, segment, self._pointers[i])
        self._buffers: dict = {}  # (group key, "grad" or ("state", name)) -> 1-D buffer
        self._adopt_existing(state)

    def intact(self) -> bool:
        """Whether every parameter still views its slot (``p.data`` was not replaced)."""
        return list(map(torch.Tensor.data_ptr, self.params)) == self._pointers

    def home(self, first: torch.Tensor, numel: int) -> Optional[Home]:
        """Where the run of ``numel`` elements that starts with parameter ``first`` lives, or
        ``None`` if ``first`` is not one of these parameters at its slot.

        Args:
            first: the run's first parameter.
            numel: the run's number of elements.
        """
        found = self._segments.get(id(first))
        if found is None:
            return None
        key, segment, pointer = found
        if first.data_ptr() != pointer:
            return None
        return Home(self, key, segment.offset, segment.offset + numel)

    def buffer(
        self, key: str, what: Union[str, tuple[str, str]], dtype: torch.dtype, device: Optional[torch.device] = None
    ) -> torch.Tensor:
        """The gradient (``what="grad"``) or state (``what=("state", name)``) buffer of group
        ``key``, of ``dtype`` on ``device`` (the group's by default): made zeroed when first needed,
        and made anew for another dtype or device (the old one lives on in the views that hold it).

        Args:
            key: a group key of ``layout``.
            what: ``"grad"`` or ``("state", name)``.
            dtype: the buffer's dtype.
            device: the buffer's device, by default the group's.
        """
        group = self.layout.groups[key]
        device = group.device if device is None else device
        buffer = self._buffers.get((key, what))
        if buffer is None or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[(key, what)] = torch.zeros(group.numel, dtype=dtype, device=device)
        return buffer

    def grad_buffers(self) -> list:
        """The gradient buffers made so far."""
        return [buffer for (_, what), buffer in self._buffers.items() if what == "grad"]

    @torch.no_grad()
    def _adopt_existing(self, state: dict) -> None:
        """Copy the gradients and parameter-shaped state tensors the parameters have into this
        group's buffers, and re-point them there."""
        for p in self.params:
            key, segment, _ = self._segments[id(p)]
            g = p.grad
            if g is not None and g.layout == torch.strided and g.shape == p.shape and g.dtype == p.dtype:
                view = segment.of(self.buffer(key, "grad", p.dtype))
                view.copy_(g)
                p.grad = view
            for name, value in list(state.get(p, {}).items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                    view = segment.of(self.buffer(key, ("state", name), value.dtype, value.device))
                    view.copy_(value)
                    state[p][name] = view


def warn_not_flat(optimizer_name: str) -> None:
    """Say (once per optimizer, the caller keeps count) that flattened parameters moved away."""
    warnings.warn(
        f"fuse_step: parameters of {optimizer_name} no longer live in the flat buffers fuse_optimizer made "
        "(was p.data replaced?); flattening them again. This warning is shown once per optimizer.",
        RuntimeWarning,
        stacklevel=5,
    )
