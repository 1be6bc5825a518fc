"""Bagua's decentralized algorithms: each rank averages its weights with peers instead of
averaging gradients.

:class:`DecentralizedAlgorithm` (full precision). On a communication step
(``(t - 1) % communication_interval == 0``, ``t`` counting training forwards from 1)::

    w_avg = mean_r w[r]                                     ("all")
    w_avg = (w[r] + w[peer(r, k)]) / 2                      ("shift_one", k-th communication; Bagua's peers)
    w[r] <- w_avg - lr * grad f_r(w[r])                     (the optimizer's step, from the local gradient)

The average of the weights at the start of the step is launched before the forward and runs
while forward and backward compute the local gradient at the local weights; after backward the
weights become the average, and the optimizer applies the local gradient to it
(``functional_bagua.distributed.averaging.mean_over_ranks`` and ``mean_with_peer``). Other
steps are plain local steps.

:class:`LowPrecisionDecentralizedAlgorithm` (8-bit differences with the ring neighbours
``left = r - 1``, ``right = r + 1`` mod n). Each rank keeps ``x_hat`` (its weights as its
neighbours know them) and ``L``, ``R`` (its neighbours' as it knows them), all equal to the
weights at wrap time. After the optimizer's step ``x`` on a communication step::

    d = x + L / 3 + R / 3 - 5/3 * x_hat,   c = Q(d)        (Q: 8-bit min-max over all the weights)
    send c to left and right; receive c_left, c_right
    L <- L + D(c_left),   R <- R + D(c_right),   x <- x_hat + D(c),   x_hat <- x

so ``x`` moves to the weighted average ``(x + L + R) / 3`` of the three, up to the quantization of
the difference (Q, D: :func:`functional_bagua.distributed.quantize` / ``dequantize``).

``hierarchical=True`` (Bagua's default): Bagua averaged within each machine first and ran the
algorithm between one leader per machine; here every rank is a peer of its own (on one machine
Bagua's leaders-only scheme with one machine degenerates to the plain average, which
``peer_selection_mode="all"`` gives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, engine_on_demand
from functional_bagua.compat.bucket import BaguaBucket  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.communication import BaguaProcessGroup
from functional_bagua.compat.fuse import is_fused_optimizer  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.tensor import BaguaTensor  # noqa: F401  # Bagua's module exports it
from functional_bagua.distributed import dequantize, quantize
from functional_bagua.distributed.averaging import PEER_SELECTION_MODES, mean_over_ranks, mean_with_peer
from functional_bagua.distributed.process_group import Group, group_src, resolve
from functional_bagua.flat import FlatLayout

if TYPE_CHECKING:
    from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel

NAME = "DecentralizedAlgorithm"

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
]


def _weights(ddp: "BaguaDistributedDataParallel") -> list[torch.Tensor]:
    return [p for _, p in ddp.named_parameters_to_sync()]


class DecentralizedAlgorithmImpl(AlgorithmImpl):
    """Full-precision decentralized SGD (module docstring).

    Args:
        process_group: the group of peers.
        hierarchical: accepted for Bagua's scripts (module docstring).
        peer_selection_mode: ``"all"`` or ``"shift_one"`` (an even number of ranks).
        communication_interval: average on every ``communication_interval``-th step.
    """

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        super().__init__(process_group)
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(f"peer_selection_mode must be one of {PEER_SELECTION_MODES}, got {peer_selection_mode!r}")
        if not isinstance(communication_interval, int) or communication_interval < 1:
            raise ValueError(f"communication_interval must be an int >= 1, got {communication_interval!r}")
        self.hierarchical, self.mode, self.interval = hierarchical, peer_selection_mode, communication_interval
        self.communications = 0
        self.peer_weight: Optional[list] = None  # the average launched before this step's forward
        self.sync = True  # False inside no_sync(): a forward of accumulated micro-batches launches nothing
        self.synced_forwards = 0  # the interval counts these (no_sync forwards are not steps)
        self.last_average: Optional[list] = None  # the last average applied
        self.weights: list[torch.Tensor] = []  # the synchronized parameters, as of init

    def init(self, ddp: "BaguaDistributedDataParallel") -> None:
        self.weights = _weights(ddp)
        self.group = resolve(self.process_group.torch_group, NAME)
        if self.mode == "shift_one" and self.group.world_size % 2:
            raise ValueError(
                f"peer_selection_mode='shift_one' needs an even number of ranks, got {self.group.world_size}"
            )

    def set_gradient_sync(self, enabled: bool) -> None:
        self.sync = enabled

    def before_forward(self, ddp: "BaguaDistributedDataParallel") -> None:
        # under no_sync() the backward's end (which applies the average) does not come: launch
        # nothing; the synchronized forward that ends the accumulation averages
        if not self.sync:
            self.peer_weight = None
            return
        self.synced_forwards += 1
        if (self.synced_forwards - 1) % self.interval != 0:
            self.peer_weight = None
            return
        weights = [p.detach() for p in self.weights]
        if self.mode == "all":
            self.peer_weight = mean_over_ranks(weights, self.group)
        else:
            self.peer_weight = mean_with_peer(weights, self.group, self.communications)
        self.communications += 1

    @torch.no_grad()
    def after_backward(self, ddp: "BaguaDistributedDataParallel") -> None:
        if self.peer_weight is None:
            return
        for p, averaged in zip(self.weights, self.peer_weight):
            p.copy_(averaged)
        self.last_average, self.peer_weight = self.peer_weight, None

    def buckets(self) -> list:
        return [self]

    @property
    def _peer_weight(self) -> Optional[torch.Tensor]:
        """Bagua's bucket attribute: the last average, flat."""
        return None if self.last_average is None else torch.cat([w.reshape(-1) for w in self.last_average])

    def bytes_per_step(self, ddp: "BaguaDistributedDataParallel") -> int:
        total = sum(p.numel() * p.element_size() for p in self.weights)
        return total // self.interval


class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD with full-precision weight averaging (module docstring; Bagua's signature).

    Args:
        hierarchical: accepted for Bagua's scripts (module docstring).
        peer_selection_mode: ``"all"`` (the mean over all ranks) or ``"shift_one"`` (one peer per
            communication, Bagua's schedule; an even number of ranks).
        communication_interval: average on every ``communication_interval``-th step.
    """

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1):
        self.hierarchical, self.peer_selection_mode = hierarchical, peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> DecentralizedAlgorithmImpl:
        return DecentralizedAlgorithmImpl(
            process_group, self.hierarchical, self.peer_selection_mode, self.communication_interval
        )


class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    """8-bit decentralized SGD with the ring neighbours (module docstring).

    Args:
        process_group: the group of peers.
        hierarchical: accepted for Bagua's scripts (module docstring).
        communication_interval: communicate on every ``communication_interval``-th step.
    """

    def __init__(
        self, process_group: BaguaProcessGroup, hierarchical: bool = True, communication_interval: int = 1
    ) -> None:
        super().__init__(process_group)
        if not isinstance(communication_interval, int) or communication_interval < 1:
            raise ValueError(f"communication_interval must be an int >= 1, got {communication_interval!r}")
        self.hierarchical, self.interval = hierarchical, communication_interval
        self.steps = 0
        self.layout: Optional[FlatLayout] = None
        self.weight: dict = {}  # x_hat, by flat-buffer key
        self.left_peer_weight: dict = {}  # L
        self.right_peer_weight: dict = {}  # R
        self.weights: list[torch.Tensor] = []  # the synchronized parameters, as of init

    def init(self, ddp: "BaguaDistributedDataParallel") -> None:
        weights = self.weights = _weights(ddp)
        stepped = {id(p) for o in ddp.bagua_optimizers for g in o.param_groups for p in g["params"]}
        if any(id(p) not in stepped for p in weights):
            raise RuntimeError(
                "LowPrecisionDecentralizedAlgorithm: every synchronized parameter must be stepped by one of the "
                "optimizers passed to with_bagua (it communicates after their step)"
            )
        self.group = resolve(self.process_group.torch_group, NAME)
        detached = [p.detach() for p in weights]
        self.layout = FlatLayout.of(detached)
        self.weight = self.layout.flatten(detached)
        self.left_peer_weight = {k: v.clone() for k, v in self.weight.items()}
        self.right_peer_weight = {k: v.clone() for k, v in self.weight.items()}

    @torch.no_grad()
    def after_step(self, ddp: "BaguaDistributedDataParallel", optimizer: torch.optim.Optimizer) -> None:
        if self.layout is None or optimizer is not ddp.bagua_optimizers[-1]:
            return  # once per training step, after the last optimizer
        self.steps += 1  # optimizer steps, whatever micro-batches were accumulated under no_sync()
        if (self.steps - 1) % self.interval != 0:
            return
        weights = [p.detach() for p in self.weights]
        x = self.layout.flatten(weights)
        new = {
            key: low_precision_ring_step(
                x[key], self.weight[key], self.left_peer_weight[key], self.right_peer_weight[key], self.group
            )
            for key in sorted(x)
        }
        for p, value in zip(weights, self.layout.unflatten(new)):
            p.copy_(value)

    def bytes_per_step(self, ddp: "BaguaDistributedDataParallel") -> int:
        n = sum(p.numel() for p in self.weights)
        return 2 * (n + 8) // self.interval  # one byte per weight plus min and max, to two neighbours

    def buckets(self) -> list:
        return [self]

    # Bagua's bucket attributes: x_hat, L and R over all the weights, flat
    @property
    def _weight(self) -> torch.Tensor:
        return _flat(self.weight)

    @property
    def _left_peer_weight(self) -> torch.Tensor:
        return _flat(self.left_peer_weight)

    @property
    def _right_peer_weight(self) -> torch.Tensor:
        return _flat(self.right_peer_weight)


@torch.no_grad()
def low_precision_ring_step(
    x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor, right: torch.Tensor, g: Group
) -> torch.Tensor:
    """One communication of 8-bit decentralized SGD on a flat buffer (module docstring)::

        d = x + L / 3 + R / 3 - 5/3 x_hat      q = quantize(d), sent to both ring neighbours
        L += dequantize(q from the left)       R += dequantize(q from the right)
        x_hat += dequantize(q)                 x <- x_hat

    Args:
        x: this rank's weights after its optimizer step, flat (not changed).
        weight: ``x_hat``, this rank's compressed replica, updated in place.
        left: ``L``, the left neighbour's replica as this rank knows it, updated in place.
        right: ``R``, the right neighbour's, updated in place.
        g: the resolved group.

    Returns:
        ``weight``: the new weights.
    """
    d = x + left / 3 + right / 3 - 5 / 3 * weight
    mine = quantize(d.unsqueeze(0))
    from_left, from_right = _exchange_with_ring(mine, g)
    left += dequantize(from_left, d.dtype)[0]
    right += dequantize(from_right, d.dtype)[0]
    weight += dequantize(mine, d.dtype)[0]
    return weight


def _flat(buffers: dict) -> torch.Tensor:
    """The flat buffers of a layout, one after the other in key order."""
    return torch.cat([buffers[k] for k in sorted(buffers)])


def _exchange_with_ring(message: torch.Tensor, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``message`` to both ring neighbours; return what the left and the right one sent.
    Tags tell the two messages apart when both neighbours are one rank (two ranks)."""
    n, rank = g.world_size, g.rank
    if n == 1:
        return message.clone(), message.clone()
    left, right = (rank - 1) % n, (rank + 1) % n
    from_left, from_right = torch.empty_like(message), torch.empty_like(message)
    ops = [
        dist.P2POp(dist.isend, message, group_src(g, right), g.group, tag=0),  # I am my right neighbour's left
        dist.P2POp(dist.isend, message, group_src(g, left), g.group, tag=1),  # and my left neighbour's right
        dist.P2POp(dist.irecv, from_left, group_src(g, left), g.group, tag=0),
        dist.P2POp(dist.irecv, from_right, group_src(g, right), g.group, tag=1),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return from_left, from_right


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD exchanging 8-bit weight differences with the ring neighbours (module
    docstring; Bagua's signature).

    Args:
        hierarchical: accepted for Bagua's scripts (module docstring).
        communication_interval: communicate on every ``communication_interval``-th step.
    """

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        self.hierarchical, self.communication_interval = hierarchical, communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> LowPrecisionDecentralizedAlgorithmImpl:
        return LowPrecisionDecentralizedAlgorithmImpl(process_group, self.hierarchical, self.communication_interval)


__getattr__ = engine_on_demand(__name__)  # Bagua's module exports BaguaDistributedDataParallel
