"""``do_flatten``: one param group's parameters of one (device, dtype) re-pointed into one buffer.

A :class:`FlatBucket` owns three kinds of buffer with one layout (parameter ``i`` at
``offsets[i]``): the parameters' (``p.data`` is a view of it, so the ``Parameter`` objects keep
their identity), the gradients' and one per state key (``optimizer.state[p]["exp_avg"]`` ...).
Gradient and state buffers are made when first needed and hold the values of whatever the
parameters had then; a parameter without a gradient or state simply leaves its slot unused.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Optional

import torch

from functional_bagua.compat.runs import fusable_on_its_device
from functional_bagua.compat.spans import gather


def trainable_by_kind(params) -> list:
    """The parameters worth flattening, as lists of one (device, dtype) each, in group order:
    those that can have a gradient, hold elements, are not 0-dim (a 0-dim parameter's state
    could not be told apart from a scalar such as ``step``) and can be fused on their device
    (:func:`~functional_bagua.compat.runs.fusable_on_its_device`: a large or half-precision CPU
    parameter is stepped on its own, so a flat copy of it would only cost memory)."""
    kinds: dict = defaultdict(list)
    for p in params:
        if (
            p.requires_grad
            and p.dim() > 0
            and p.numel() > 0
            and p.layout == torch.strided
            and p.is_contiguous()
            and fusable_on_its_device(p)
        ):
            kinds[(p.device, p.dtype)].append(p)
    return [ps for ps in kinds.values() if len(ps) > 1]


class FlatBucket:
    """Parameters of one group and (device, dtype), back to back in ``params_buffer``."""

    def __init__(self, params: list, state: dict):
        self.params = list(params)
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.params_buffer, views = gather(self.params)
        with torch.no_grad():
            for p, view in zip(self.params, views):
                p.data = view
        self._pointers = list(map(torch.Tensor.data_ptr, self.params))
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.grads_buffer: Optional[torch.Tensor] = None
        self.state_buffers: dict = {}
        self._adopt_existing(state)

    def intact(self) -> bool:
        """Whether every parameter still views its slot (``p.data`` was not replaced)."""
        return list(map(torch.Tensor.data_ptr, self.params)) == self._pointers

    def slot(self, first: torch.Tensor, numel: int) -> Optional[tuple]:
        """``(start, end)`` in this bucket of the run of ``numel`` elements starting at parameter
        ``first``; ``None`` if ``first`` is not in this bucket at its slot."""
        i = self._index.get(id(first))
        if i is None or first.data_ptr() != self._pointers[i]:
            return None
        return self.offsets[i], self.offsets[i] + numel

    def grads_slice(self, start: int, end: int) -> torch.Tensor:
        if self.grads_buffer is None:
            self.grads_buffer = torch.zeros_like(self.params_buffer)
        return self.grads_buffer[start:end]

    def state_slice(self, key, dtype: torch.dtype, device: torch.device, start: int, end: int) -> torch.Tensor:
        """The slice of ``key``'s state buffer; a buffer of another dtype or device is replaced (the
        views of the old one keep it alive until they are gathered again)."""
        buf = self.state_buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = self.state_buffers[key] = torch.zeros(self.numel, dtype=dtype, device=device)
        return buf[start:end]

    def _adopt_existing(self, state: dict) -> None:
        """Copy the gradients and parameter-shaped state tensors the parameters already have into
        this bucket's buffers, and re-point them there."""
        for i, p in enumerate(self.params):
            start, end = self.offsets[i], self.offsets[i] + p.numel()
            g = p.grad
            if g is not None and g.layout == torch.strided and g.shape == p.shape and g.dtype == p.dtype:
                view = self.grads_slice(start, end).view(p.shape)
                view.copy_(g)
                p.grad = view
            for key, value in list(state.get(p, {}).items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape:
                    view = self.state_slice(key, value.dtype, value.device, start, end).view(p.shape)
                    view.copy_(value)
                    state[p][key] = view


def flatten_group(params, state: dict) -> list:
    """:class:`FlatBucket` s for one param group's parameters (see :func:`trainable_by_kind`)."""
    return [FlatBucket(ps, state) for ps in trainable_by_kind(params)]


def warn_not_flat(optimizer_name: str) -> None:
    warnings.warn(
        f"fuse_step: parameters of {optimizer_name} no longer live in the flat buffers fuse_optimizer made "
        "(was p.data replaced?); flattening them again. This warning is shown once per optimizer.",
        RuntimeWarning,
        stacklevel=4,
    )
