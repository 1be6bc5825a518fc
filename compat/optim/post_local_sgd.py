"""torch's ``PostLocalSGDOptimizer``: an optimizer's step followed by a model averager's::

    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      averagers.PeriodicModelAverager(period=4, warmup_steps=100))
    optimizer.step()             # local step, then every 4th step (after 100) the parameters are averaged

Used with torch's DDP and its ``post_localSGD_hook`` (gradients all-reduced for the first
``start_localSGD_iter`` steps, local after), it is post-local SGD. ``state_dict()`` adds the
averager's ``"step"``; ``load_state_dict`` restores it, or warns and restarts at 0 when the dict has none.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

from functional_bagua.compat.optim.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """``optim``'s step, then ``averager.average_parameters(param_groups)`` (module docstring).

    Args:
        optim: the local optimizer (any ``torch.optim.Optimizer``).
        averager: a :class:`~functional_bagua.compat.optim.averagers.ModelAverager`.
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(f"PostLocalSGDOptimizer: optim must be a torch.optim.Optimizer, got {type(optim).__name__}")
        if not isinstance(averager, ModelAverager) and not callable(getattr(averager, "average_parameters", None)):
            raise TypeError(f"PostLocalSGDOptimizer: averager must be a ModelAverager, got {type(averager).__name__}")
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    def state_dict(self) -> dict[str, Any]:
        """``optim``'s state dict with the averager's step count under ``"step"``."""
        state = self.optim.state_dict()
        state["step"] = self.averager.step
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``optim``'s state and the averager's step count (0, with a warning, when missing).

        Args:
            state_dict: as :meth:`state_dict` returns it.
        """
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn(
                "Loaded state dict does not contain a step counter for an averager. Setting step counter to 0.",
                stacklevel=2,
            )
            self.averager.step = 0

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One local step of ``optim`` (with ``closure`` if given), then the averager's.

        Args:
            closure: passed to ``optim.step``.
        """
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optim.zero_grad(set_to_none)``.

        Args:
            set_to_none: drop the gradients instead of zeroing them.
        """
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``optim.add_param_group(param_group)``.

        Args:
            param_group: a param group, as torch's optimizers take it.
        """
        self.optim.add_param_group(param_group)
