"""torch's model averagers (``torch.distributed.algorithms.model_averaging.averagers``) on
functional_bagua's averaging rule.

``PeriodicModelAverager(period, warmup_steps)`` averages on the steps where
``functional_bagua.distributed.averaging.periodic_due`` holds (``periodic_average``'s rule)::

    step >= warmup_steps and (step - warmup_steps) % period == 0:    p <- mean_r p[r]

``HierarchicalModelAverager({period: group_size, ...}, warmup_steps)`` averages, on each step after
the warmup, within the groups of the largest period dividing the step (groups of ``group_size``
consecutive ranks; the last entry's size is the whole group). The mean is
``functional_bagua.distributed.averaging.mean_over_ranks`` (a flat buffer per dtype, divided by
the group size, summed), over the parameters given, param groups or a module's parameters, of
which only those with a gradient take part (as torch's). Beyond torch: the hierarchical averager
builds its subgroups from explicit rank lists, so it runs on the CPU with gloo too.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from functional_bagua.distributed.averaging import mean_over_ranks, periodic_due
from functional_bagua.distributed.process_group import resolve

__all__ = ["ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager", "average_parameters"]


def params_to_average(params: Iterable[Any]) -> list[torch.Tensor]:
    """The parameters with a gradient among ``params``: parameters, or param groups (dicts with
    ``"params"``), as torch's averagers take them.

    Args:
        params: parameters, param groups, or a mix.
    """
    chosen: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            chosen += [p for p in item["params"] if p.grad is not None]
        elif isinstance(item, torch.Tensor):
            if item.grad is not None:
                chosen.append(item)
        else:
            raise TypeError(f"expected parameters or param groups to average, got {type(item).__name__}")
    return chosen


@torch.no_grad()
def average_parameters(params: Iterable[Any], process_group: Optional[dist.ProcessGroup] = None) -> None:
    """Replace each parameter (with a gradient) of ``params`` by its mean over ``process_group``.

    Args:
        params: parameters or param groups (a generator such as ``model.parameters()`` too).
        process_group: the group; ``None`` for the default group. A process outside it does nothing.
    """
    group = dist.group.WORLD if process_group is None else process_group
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        return
    chosen = params_to_average(params)
    if not chosen:
        return
    g = resolve(group, "average_parameters")
    for p, mean in zip(chosen, mean_over_ranks([p.detach() for p in chosen], g)):
        p.copy_(mean)


class ModelAverager:
    """Averages parameters over ``process_group`` on some steps; ``step`` counts the calls of
    :meth:`average_parameters`.

    Args:
        process_group: the group; ``None`` for the default group.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__}: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group() first"
            )
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.step = 0

    def average_parameters(self, params: Iterable[Any]) -> None:
        """Average ``params`` if this step is due, and count the step.

        Args:
            params: parameters, param groups or ``module.parameters()``.
        """
        raise NotImplementedError(f"{type(self).__name__} must define average_parameters(params)")


class PeriodicModelAverager(ModelAverager):
    """Average every ``period`` steps once ``warmup_steps`` are done (module docstring).

    Args:
        period: an int ``>= 1``.
        warmup_steps: an int ``>= 0``: the first step that averages.
        process_group: the group; ``None`` for the default group.

    Example::

        averager = PeriodicModelAverager(period=4, warmup_steps=100)
        optimizer.step(); averager.average_parameters(model.parameters())
    """

    def __init__(self, period: int = 1, warmup_steps: int = 0, process_group: Optional[dist.ProcessGroup] = None):
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"Arg ``warmup_steps`` must be a non-negative int, got {warmup_steps!r}")
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"Arg ``period`` must be a positive int, got {period!r}")
        if period == 1:
            warnings.warn(
                "When period is 1, no need to use model averaging because the communication cost of "
                "all-reducing parameters will be no less than the cost of all-reducing gradients by "
                "DistributedDataParallel in the backward pass. Therefore, only DistributedDataParallel "
                "should be used for this case.",
                stacklevel=2,
            )
        super().__init__(process_group)
        self.period, self.warmup_steps = period, warmup_steps

    def average_parameters(self, params: Iterable[Any]) -> None:
        if periodic_due(self.step, self.period, self.warmup_steps):
            average_parameters(params, self.process_group)
        self.step += 1


class HierarchicalModelAverager(ModelAverager):
    """Average within nested groups at several periods (module docstring).

    Args:
        period_group_size_dict: ``{period: group_size}``, periods increasing, the last size the
            whole group's (e.g. ``OrderedDict([(2, 4), (8, 16)])``).
        warmup_steps: an int ``>= 0``: no averaging before this step.
        process_group: the group; ``None`` for the default group.
    """

    def __init__(
        self,
        period_group_size_dict: Optional[dict] = None,
        warmup_steps: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__(process_group)
        if not period_group_size_dict:
            raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
        self._periods = list(period_group_size_dict)
        if self._periods[0] <= 0:
            raise ValueError("The minimum period in arg ``period_group_size_dict`` must be a positive value.")
        if self._periods != sorted(self._periods):
            raise ValueError(f"the periods of ``period_group_size_dict`` must increase, got {self._periods}")
        if self._periods[-1] == 1:
            warnings.warn(
                "When the maximum period in arg ``period_group_size_dict`` is 1, no need to use model averaging "
                "because the communication cost of all-reducing parameters will be no less than the cost of "
                "all-reducing gradients by DistributedDataParallel in the backward pass.",
                stacklevel=2,
            )
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        ranks = dist.get_process_group_ranks(self.process_group)
        sizes = list(period_group_size_dict.values())
        if sizes[-1] != len(ranks):
            raise ValueError(
                f"The last value in arg ``period_group_size_dict`` {sizes[-1]} must be equal to the size of "
                f"arg ``process_group`` {len(ranks)}."
            )
        self.warmup_steps = warmup_steps
        self.period_process_group_dict: OrderedDict = OrderedDict()
        for period, size in period_group_size_dict.items():
            self.period_process_group_dict[period] = self._subgroup(ranks, size)

    def _subgroup(self, ranks: list[int], size: int) -> Any:
        """This process's group of ``size`` consecutive ranks (every process makes every group)."""
        if size == len(ranks):
            return self.process_group
        if size <= 0 or len(ranks) % size:
            raise ValueError(f"a group size must divide the group's {len(ranks)} ranks, got {size}")
        mine = None
        for start in range(0, len(ranks), size):
            members = ranks[start : start + size]
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
        return mine

    def average_parameters(self, params: Iterable[Any]) -> None:
        if self.step >= self.warmup_steps:
            for period in reversed(self._periods):
                if self.step % period == 0:
                    average_parameters(params, self.period_process_group_dict[period])
                    break
        self.step += 1
