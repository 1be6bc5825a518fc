"""Gradient accumulation: one optimizer step per ``k`` micro-batches.

``multi_steps(inner, k)`` sums the gradients of ``k`` consecutive calls, then runs ``inner`` once
on their mean (or sum)::

    a_j = a_{j-1} + g_j                      (j = 1..k, in the accumulator dtype)
    u   = inner(a_k / k)   at j = k,  else 0 (and inner's state is kept)

With equal micro-batches and a mean loss, ``mean_j g_j`` is the gradient of the whole
``k``-times batch, so the parameters follow the same path as one step per big batch, and as
torch's ``(loss / k).backward()`` accumulation followed by ``optimizer.step()``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import optree
import torch

from functional_bagua import checks, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import zero_count
from functional_bagua.tree import PyTree


class MultiStepsState(NamedTuple):
    """``mini_step``: micro-batches summed in the current window (0..k-1); ``gradient_step``: inner
    steps done; ``inner_state``; ``acc_grads``: the window's gradient sum, one tensor per parameter."""

    mini_step: torch.Tensor
    gradient_step: torch.Tensor
    inner_state: Any
    acc_grads: Any


def multi_steps(
    inner: GradientTransformation,
    every_k_schedule: int,
    *,
    use_grad_mean: bool = True,
    accumulator_dtype: Optional[torch.dtype] = None,
) -> GradientTransformation:
    """Run ``inner`` once every ``every_k_schedule`` updates, on the accumulated gradients
    (module docstring). The other updates are zeros and leave ``inner``'s state as it was.

    ``accumulator_dtype`` (default: each parameter's dtype) holds the running sum, e.g.
    ``torch.float32`` for bfloat16 parameters; the mean is rounded to the parameter's dtype once,
    before ``inner`` sees it. A ``None`` gradient adds nothing to the sum; a parameter whose
    gradient is ``None`` on every micro-batch of a window reaches ``inner`` with a zero gradient
    (torch.optim would skip it; ``torch.func.grad`` never yields ``None``).

    Eagerly, the inner step runs only at the end of a window (a Python branch on
    ``mini_step``). Under torch.compile the step is branch-free: ``inner`` runs on every call
    and ``torch.where`` keeps its result only at the end of a window, so one graph serves all
    ``k`` calls; both paths give the same numbers.

    Example (an effective batch of 4 micro-batches)::

        tx = fb.multi_steps(fb.adamw(1e-3), every_k_schedule=4)

    Args:
        inner: the transform run once per window, on the window's accumulated gradients.
        every_k_schedule: ``k``, the number of updates (micro-batches) per window, an int >= 1
            (a ValueError otherwise).
        use_grad_mean: with ``True``, ``inner`` sees the mean ``a_k / k`` of the window's
            gradients; with ``False``, their sum ``a_k``.
        accumulator_dtype: the floating point dtype of the running sums (a TypeError for another
            dtype); ``None`` keeps each parameter's dtype.

    Returns:
        A GradientTransformation whose state is a :class:`MultiStepsState`; its updates are zeros
        except on the last update of each window, where they are ``inner``'s.
    """
    k = every_k_schedule
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"every_k_schedule must be an int >= 1, got {k!r}")
    if accumulator_dtype is not None and not accumulator_dtype.is_floating_point:
        raise TypeError(f"accumulator_dtype must be a floating point dtype, got {accumulator_dtype}")

    def init(params: PyTree) -> MultiStepsState:
        return MultiStepsState(
            zero_count(params), zero_count(params), inner.init(params), tree.tree_map(_zeros_for_sum, params)
        )

    def _zeros_for_sum(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if p is None else torch.zeros_like(p, dtype=accumulator_dtype or p.dtype)

    def update(
        grads: PyTree, state: MultiStepsState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, MultiStepsState]:
        acc_leaves, spec = tree.flatten(state.acc_grads)
        grad_leaves = tree.leaves_matching(spec, grads, "grads", "the params the state was made for")
        _check_grads(grad_leaves, acc_leaves, params, spec)
        acc = spec.unflatten([a if g is None else a + g.to(a.dtype) for a, g in zip(acc_leaves, grad_leaves)])
        mini_step = state.mini_step + 1
        if torch.compiler.is_compiling():
            return _select_at_window_end(mini_step == k, grads, acc, state, params)
        if int(mini_step) < k:
            zeros = tree.tree_map(_zeros_like_grad, grads)
            return zeros, MultiStepsState(mini_step, state.gradient_step, state.inner_state, acc)
        updates, inner_state = inner.update(_average(acc, grads, params), state.inner_state, params)
        reset = tree.tree_map(torch.zeros_like, acc)
        return updates, MultiStepsState(torch.zeros_like(mini_step), state.gradient_step + 1, inner_state, reset)

    def _average(acc: PyTree, grads: PyTree, params: Optional[PyTree]) -> PyTree:
        """The gradient ``inner`` sees: the window's mean (or sum), rounded to the dtype of the
        gradient (or, where this call's gradient is ``None``, of the parameter)."""
        divisor = k if use_grad_mean else 1
        like = grads if params is None else params
        return tree.tree_map(
            lambda a, g, p: None if a is None else (a / divisor).to(_dtype_of(g, p, a)), acc, grads, like
        )

    def _select_at_window_end(
        at_end: torch.Tensor, grads: PyTree, acc: PyTree, state: MultiStepsState, params: Optional[PyTree]
    ) -> tuple[PyTree, MultiStepsState]:
        updates, inner_state = inner.update(_average(acc, grads, params), state.inner_state, params)
        return tree.zeros_unless(at_end, updates), MultiStepsState(
            torch.where(at_end, 0, state.mini_step + 1),
            state.gradient_step + at_end.long(),
            tree.where(at_end, inner_state, state.inner_state),
            tree.zeros_unless(~at_end, acc),
        )

    return GradientTransformation(init, update)


def _check_grads(grad_leaves: list, acc_leaves: list, params: Optional[PyTree], spec: optree.PyTreeSpec) -> None:
    """Each gradient fits its parameter (or, without ``params``, the accumulator's shape): the sum
    would broadcast a gradient of another shape."""
    param_leaves = (
        [None] * len(grad_leaves) if params is None else tree.leaves_matching(spec, params, "params", "grads")
    )
    for i, (g, a, p) in enumerate(zip(grad_leaves, acc_leaves, param_leaves)):
        if g is None:
            continue
        name = functools.partial(tree.leaf_name, spec, i)
        checks.check_grad(g, p, name, "multi_steps")
        if a is not None and g.shape != a.shape:
            raise ValueError(
                f"multi_steps: gradient of {name()!r} has shape {tuple(g.shape)}, parameter has {tuple(a.shape)}"
            )


def _dtype_of(*candidates: Optional[torch.Tensor]) -> torch.dtype:
    return next(c for c in candidates if c is not None).dtype


def _zeros_like_grad(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if g is None else torch.zeros_like(g)


class MultiSteps:
    """optax-style class around :func:`multi_steps`: ``MultiSteps(inner, k).init/.update``,
    ``.gradient_transformation()`` for use in ``chain``, and ``has_updated(state)``.

    Args:
        opt: the transform run once per window (``inner`` of :func:`multi_steps`).
        every_k_schedule: the number of updates (micro-batches) per window, an int >= 1.
        use_grad_mean: with ``True``, ``opt`` sees the mean of the window's gradients; with
            ``False``, their sum.
        accumulator_dtype: the floating point dtype of the running sums; ``None`` keeps each
            parameter's dtype.

    Example::

        ms = fb.MultiSteps(fb.adamw(1e-3), every_k_schedule=4)
        updates, state = ms.update(grads, state, params)
        if ms.has_updated(state): ...          # True after every 4th update
    """

    def __init__(
        self,
        opt: GradientTransformation,
        every_k_schedule: int,
        use_grad_mean: bool = True,
        accumulator_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self._tx = multi_steps(opt, every_k_schedule, use_grad_mean=use_grad_mean, accumulator_dtype=accumulator_dtype)
        self.init = self._tx.init
        self.update = self._tx.update

    def gradient_transformation(self) -> GradientTransformation:
        """The wrapped transform, for use in ``chain``.

        Returns:
            The GradientTransformation made by :func:`multi_steps` (the same ``init`` and ``update``).
        """
        return self._tx

    @staticmethod
    def has_updated(state: MultiStepsState) -> torch.Tensor:
        """Whether the last update ran the inner optimizer (the window just closed).

        Args:
            state: the :class:`MultiStepsState` returned by the last ``update``.

        Returns:
            A 0-dim bool tensor, ``True`` when ``mini_step`` is back at 0 after at least one inner step.
        """
        return (state.mini_step == 0) & (state.gradient_step > 0)
