"""Model averaging as transforms: the last link of a chain, they turn the local update ``u`` of
parameters ``p`` into ``u'`` with ``p + u' = W(p, u)``, some average over the ranks.

``periodic_average(period, warmup_steps)`` (local SGD; torch's ``PeriodicModelAverager`` rule)::

    due(t) = t >= warmup_steps and (t - warmup_steps) % period == 0         (t = 0, 1, 2, ...)
    p_{t+1} = mean_r (p_t + u_t)[r]    if due(t),    else p_t + u_t

``decentralized(peer_selection_mode, communication_interval)`` (Bagua's decentralized SGD: the
local update is computed at the local weights and added to the weights averaged with peers)::

    p_{t+1} = W(p_t) + u_t    if t % communication_interval == 0,    else p_t + u_t
    "all":       W(p)[r] = mean_j p[j]
    "shift_one": W(p)[r] = (p[r] + p[peer(r, s)]) / 2, s = t // communication_interval, with
                 h = n / 2 (n even):  peer(r, s) = h + (s + r) % h  if r < h,  else (r - h - s) % h

Eagerly the averaging runs only on due steps; under torch.compile the step is one graph, so the
collective runs every step and its result is selected branch-free (same numbers, more traffic).

Example (local SGD, averaging every 4 steps after 100)::

    tx = fb.chain(fb.sgd(0.1, momentum=0.9), fbd.periodic_average(period=4, warmup_steps=100))
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Union, overload

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from functional_bagua import checks, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.distributed import collectives
from functional_bagua.distributed.process_group import Agreement, Group, resolve
from functional_bagua.flat import FlatLayout
from functional_bagua.numerics import zero_count
from functional_bagua.tree import PyTree

PEER_SELECTION_MODES = ("all", "shift_one")


class AveragingState(NamedTuple):
    """``count``: the number of updates so far (int64, 0-dim)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax


def periodic_average(
    period: int, warmup_steps: int = 0, group: Optional[dist.ProcessGroup] = None
) -> GradientTransformation:
    """Average the parameters over the ranks on the steps PeriodicModelAverager averages (module
    docstring). Needs ``params``; parameters whose update is ``None`` are not averaged (torch
    leaves out parameters without ``.grad``).

    Args:
        period: an int ``>= 1``: average on every ``period``-th step once the warmup is over.
        warmup_steps: an int ``>= 0``: the steps before the first average, which is on step
            ``warmup_steps`` (steps count from 0).
        group: the process group; ``None`` for the default group.

    Returns:
        A :class:`~functional_bagua.GradientTransformation` whose state is an :class:`AveragingState`.

    Example::

        tx = fb.chain(fb.sgd(0.1), fbd.periodic_average(period=4))
        state = tx.init(params)
    """
    if not isinstance(period, int) or period < 1:
        raise ValueError(f"periodic_average: period must be an int >= 1, got {period!r}")
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"periodic_average: warmup_steps must be an int >= 0, got {warmup_steps!r}")

    def due(count: torch.Tensor) -> torch.Tensor:
        return periodic_due(count, period, warmup_steps)

    def average_locals(params: list, updates: list, local: list, g: Group, count: torch.Tensor) -> list:
        return mean_over_ranks(local, g)

    settings = dict(period=period, warmup_steps=warmup_steps)
    return _averaging("periodic_average", settings, due, average_locals, group)


def periodic_due(count: Any, period: int, warmup_steps: int = 0) -> Any:
    """Whether step ``count`` (from 0) averages under ``periodic_average(period, warmup_steps)``:
    ``count >= warmup_steps and (count - warmup_steps) % period == 0`` (a bool for an int count, a
    0-dim bool tensor for a tensor one).

    Args:
        count: the step, an int or an integer tensor.
        period: averages every ``period`` steps after the warmup.
        warmup_steps: the first step that averages.
    """
    return (count >= warmup_steps) & ((count - warmup_steps) % period == 0)


def decentralized(
    peer_selection_mode: str = "all", communication_interval: int = 1, group: Optional[dist.ProcessGroup] = None
) -> GradientTransformation:
    """Average the weights with peers before adding the local update (module docstring); needs ``params``.

    Args:
        peer_selection_mode: ``"all"`` (the mean over all ranks) or ``"shift_one"`` (the mean with one
            peer per round, which needs an even world size: ``init`` raises a ValueError otherwise).
        communication_interval: an int ``>= 1``: average on every ``communication_interval``-th step,
            starting with step 0.
        group: the process group; ``None`` for the default group.

    Returns:
        A :class:`~functional_bagua.GradientTransformation` whose state is an :class:`AveragingState`.

    Example::

        tx = fb.chain(fb.sgd(0.1), fbd.decentralized("shift_one", communication_interval=2))
        state = tx.init(params)
    """
    if peer_selection_mode not in PEER_SELECTION_MODES:
        raise ValueError(
            f"decentralized: peer_selection_mode must be one of {PEER_SELECTION_MODES}, got {peer_selection_mode!r}"
        )
    if not isinstance(communication_interval, int) or communication_interval < 1:
        raise ValueError(f"decentralized: communication_interval must be an int >= 1, got {communication_interval!r}")

    def due(count: torch.Tensor) -> torch.Tensor:
        return count % communication_interval == 0

    def average_then_add(params: list, updates: list, local: list, g: Group, count: torch.Tensor) -> list:
        if peer_selection_mode == "all":
            averaged = mean_over_ranks(params, g)
        else:
            averaged = mean_with_peer(params, g, count // communication_interval)
        return [a + u for a, u in zip(averaged, updates)]

    def check_world(g: Group) -> None:
        if peer_selection_mode == "shift_one" and g.world_size % 2:
            raise ValueError(
                f"decentralized: peer_selection_mode='shift_one' needs an even world size, got {g.world_size}"
            )

    settings = dict(peer_selection_mode=peer_selection_mode, communication_interval=communication_interval)
    return _averaging("decentralized", settings, due, average_then_add, group, check_world)


def _averaging(
    name: str,
    settings: dict,
    due: Callable[[torch.Tensor], torch.Tensor],
    average: Callable[[list, list, list, Group, torch.Tensor], list],
    group: Optional[dist.ProcessGroup],
    check_world: Optional[Callable[[Group], None]] = None,
) -> GradientTransformation:
    """A transform that replaces ``local = p + u`` by ``average(p, u, local, group, count)`` (lists
    over the parameters that have an update) on the steps where ``due(count)``. ``init`` checks
    that every rank built it with the same ``settings`` and holds parameters of the same names,
    shapes and dtypes (their values may differ: averaging is what brings them together)."""
    agreement = Agreement(name, settings)

    def init(params: PyTree) -> AveragingState:
        g = resolve(group, name)
        if check_world is not None:
            check_world(g)
        agreement.init(params, g)
        return AveragingState(zero_count(params))

    def update(
        updates: PyTree, state: AveragingState, params: Optional[PyTree] = None
    ) -> tuple[PyTree, AveragingState]:
        if params is None:
            raise ValueError(f"{name} needs the parameters: call update(grads, state, params)")
        g = resolve(group, name)
        update_leaves, param_leaves, spec = tree.leaves_with_params(updates, params)
        agreement.check(param_leaves)
        kept = [i for i, u in enumerate(update_leaves) if u is not None]
        for i in kept:
            checks.check_update(update_leaves[i], param_leaves[i], functools.partial(tree.leaf_name, spec, i), name)
        params_kept, updates_kept = [param_leaves[i] for i in kept], [update_leaves[i] for i in kept]
        local = [p + u for p, u in zip(params_kept, updates_kept)]
        is_due = due(state.count)
        if torch.compiler.is_compiling():
            new = tree.where(is_due, average(params_kept, updates_kept, local, g, state.count), local)
        else:
            new = average(params_kept, updates_kept, local, g, state.count) if bool(is_due) else local
        out = list(update_leaves)
        for i, n in zip(kept, new):
            out[i] = (n - param_leaves[i]).to(update_leaves[i].dtype)
        return spec.unflatten(out), AveragingState(state.count + 1)

    update.agree_on_chain = functools.partial(agreement.agree_on_chain, group=group)  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


def mean_over_ranks(tensors: list, g: Group) -> list:
    """``mean_r tensors[r]``, computed as torch's model averaging does: one flat buffer per dtype,
    divided by the world size, then all-reduced (sum).

    Args:
        tensors: this rank's tensors (a list).
        g: the resolved process group (:func:`~functional_bagua.distributed.process_group.resolve`).
    """
    layout = FlatLayout.of(tensors)
    sums = {key: funcol.all_reduce(b / g.world_size, "sum", g.group) for key, b in layout.flatten(tensors).items()}
    return layout.unflatten(sums)


@overload
def peer_of(rank: int, world_size: int, s: int) -> int: ...


@overload
def peer_of(rank: int, world_size: int, s: torch.Tensor) -> torch.Tensor: ...


def peer_of(rank: int, world_size: int, s: Union[int, torch.Tensor]) -> Union[int, torch.Tensor]:
    """Bagua's shift_one peer of ``rank`` at communication round ``s`` (an int or a tensor).

    Args:
        rank: a rank within the group (an int).
        world_size: the number of ranks in the group, even.
        s: the communication round.
    """
    h = world_size // 2
    return h + (s + rank) % h if rank < h else (rank - h - s) % h


def mean_with_peer(tensors: list, g: Group, s: Union[int, torch.Tensor]) -> list:
    """``(x[rank] + x[peer]) / 2`` for each tensor, the peer chosen by :func:`peer_of`. Eagerly one
    all-to-all that sends the buffers to the peer only; under torch.compile (where the peer is a
    tensor) an all-gather from which the peer's buffers are taken.

    Args:
        tensors: this rank's tensors (a list).
        g: the resolved process group, of an even world size.
        s: the communication round: an int eagerly, a tensor under torch.compile.
    """
    layout = FlatLayout.of(tensors)
    mine = layout.flatten(tensors)
    theirs = {}
    if torch.compiler.is_compiling():
        assert isinstance(s, torch.Tensor)  # the round is a tensor under torch.compile
        peer = peer_of(g.rank, g.world_size, s)
        for key, b in mine.items():
            theirs[key] = (
                collectives.all_gather_single(b.unsqueeze(0), 0, g.group).index_select(0, peer.reshape(1)).reshape(-1)
            )
    else:
        peer_rank = peer_of(g.rank, g.world_size, int(s))
        for key, b in mine.items():
            splits = [b.numel() if r == peer_rank else 0 for r in range(g.world_size)]
            theirs[key] = funcol.all_to_all_single(b, splits, splits, g.group)
    return layout.unflatten({key: (mine[key] + theirs[key]) / 2 for key in mine})
