"""Updates a link of a chain may overwrite: the temporaries its predecessor made for it.

In :func:`~functional_bagua.chain`, each link's updates feed the next link and nothing else.
A link that declares the updates it returns fresh (``update.fresh_updates = True``: new tensors
that no gradient, parameter, state or other update shares memory with) hands them to the next
link, which may then compute its result in them instead of in new tensors::

    u = scale_by_adam(g)          # fresh
    u = u.add_(p, alpha=wd)       # add_decayed_weights, in place: the numbers of u.add(p, alpha=wd)
    u = u.mul_(-lr)               # scale_by_learning_rate, in place: those of u * -lr

The numbers are the same bit for bit (the same kernels); each step writes two tensors fewer, which
on large tensors is about a third of a pass each. The grant is to one transform: the chain names
the ``update`` function it calls next, and only that function sees it (:func:`granted_to`), so a
transform nested inside a link (a masked or lookahead's inner one) never overwrites what its
container passes it. The state is a ``threading.local``, which torch.compile traces (a
``ContextVar`` it cannot), and in a traced step the in-place ops are functionalized away.

**State given up.** A caller that keeps only the new state an update returns (``fb.Optimizer``,
which holds its state and nothing else does) may give the old one up: the transform may then
compute its new state in the old state's tensors (``foreach.updated``: ``mu.lerp_(g, 1 - b1)``
instead of ``lerp(mu, g, 1 - b1)``), the same numbers with one tensor fewer per field and step, as
torch.optim's in-place steps. The grant is to one update function, as above: a chain passes it to
each of its links, ``inject_hyperparams`` to the transform it builds and ``schedule_free`` to its
step of ``z``, and nothing else does, so a wrapper that may keep the old state
(``apply_if_finite`` after a non-finite gradient) never sees its inner transform overwrite it.
Eager only: a traced update is pure. As with torch.optim's in-place steps, an error raised by a
later link, after a rule stepped its state in place, leaves that state part-stepped.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

if TYPE_CHECKING:  # base imports this module
    from functional_bagua.base import GradientTransformation


class _Grant(threading.local):
    def __init__(self) -> None:
        self.to: Optional[Callable[..., Any]] = None
        self.state_to: Optional[Callable[..., Any]] = None


_GRANT = _Grant()


def granted_to(update: Callable[..., Any]) -> bool:
    """Whether the chain running now handed ``update`` (a transform's update function) updates
    it may overwrite.

    Args:
        update: the caller's own update function.
    """
    granted = _GRANT.to
    return granted is not None and (granted is update or getattr(granted, "__wrapped__", None) is update)


def update_owning(tx: "GradientTransformation", owned: bool, *args: Any) -> Any:
    """``tx.update(*args)``, telling it whether it may overwrite the updates it is given.

    Args:
        tx: the link to run.
        owned: whether the updates in ``args`` are fresh temporaries nothing else holds.
        *args: ``update``'s arguments.
    """
    previous = _GRANT.to
    _GRANT.to = tx.update if owned else None
    try:
        return tx.update(*args)
    finally:
        _GRANT.to = previous


def returns_fresh_updates(tx: "GradientTransformation") -> bool:
    """Whether ``tx`` declares its updates fresh (module docstring)."""
    return getattr(tx.update, "fresh_updates", False)


def _is(granted: Optional[Callable[..., Any]], update: Callable[..., Any]) -> bool:
    return granted is not None and (granted is update or getattr(granted, "__wrapped__", None) is update)


def state_given_to(update: Callable[..., Any]) -> bool:
    """Whether the caller running now gave ``update`` (a transform's update function) the state
    it passes, to compute the new state in (module docstring); never while torch.compile traces.

    Args:
        update: the caller's own update function.
    """
    return _is(_GRANT.state_to, update) and not torch.compiler.is_compiling()


@contextlib.contextmanager
def giving_state(update: Optional[Callable[..., Any]]) -> Iterator[None]:
    """Within the block, ``update`` (``None``: no one) may compute its new state in the state it
    is given (module docstring).

    Args:
        update: the update function of the transform called next, given its state.
    """
    previous = _GRANT.state_to
    _GRANT.state_to = update
    try:
        yield
    finally:
        _GRANT.state_to = previous


def update_giving_state(tx: "GradientTransformation", *args: Any) -> Any:
    """``tx.update(*args)``, its state given up (module docstring): the caller keeps only the new
    state it returns.

    Args:
        tx: the transform to run.
        *args: ``update``'s arguments.
    """
    with giving_state(tx.update):
        return tx.update(*args)
