"""Bagua's ``bagua.torch_api.contrib.fuse.optimizer``: the fused optimizer
(:mod:`functional_bagua.compat.fuse`) under Bagua's module path, and the helpers of that module
that Bagua's own tests call, which find tensors lying back to back in memory:

- :func:`calculate_mutual_groups`: for several lists of tensors of one length (the parameters
  and each of their state tensors, say), the groups of positions whose tensors lie back to back,
  in address order, in every list, so that all of them can be viewed as one flat tensor each.
"""

from __future__ import annotations

from typing import Sequence

import torch

from functional_bagua.compat.fuse import fuse_optimizer, fuse_step, is_fused_optimizer
from functional_bagua.compat.utils import check_contiguous

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer", "check_contiguous", "calculate_mutual_groups"]


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size()


def _is_contiguous_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether one of ``a`` and ``b`` starts where the other ends."""
    return a.data_ptr() == _end(b) or b.data_ptr() == _end(a)


def _find_continuous_tensors(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """The positions of ``tensors`` grouped into runs that lie back to back, each run in address
    order and of at least two tensors; the runs in address order."""
    by_address = sorted(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    runs: list[list[int]] = []
    current: list[int] = []
    for i in by_address:
        if current and tensors[i].data_ptr() != _end(tensors[current[-1]]):
            runs.append(current)
            current = []
        current.append(i)
    runs.append(current)
    return [run for run in runs if len(run) > 1]


def _intersect(a: Sequence[list[int]], b: Sequence[list[int]]) -> list[list[int]]:
    """The groups of ``a`` that ``b`` also has, in ``a``'s order."""
    return [group for group in a if group in b]


def calculate_mutual_groups(tensors_list: Sequence[Sequence[torch.Tensor]]) -> list[list[int]]:
    """The runs of :func:`_find_continuous_tensors` that every list of ``tensors_list`` has
    (module docstring); ``[]`` for no lists. Every list must have the same length (an
    AssertionError otherwise, as Bagua's).

    Args:
        tensors_list: lists of tensors, position ``i`` of each list belonging together.
    """
    if not tensors_list:
        return []
    size = len(tensors_list[0])
    groups = None
    for tensors in tensors_list:
        assert len(tensors) == size, "Tensors to calculate mutual groups must have equal size."
        found = _find_continuous_tensors(tensors)
        groups = found if groups is None else _intersect(groups, found)
    return groups or []
