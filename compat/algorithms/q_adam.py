"""Bagua's QAdam: Adam whose momentum is averaged in 8 bits once a warmup is over.

:class:`QAdamOptimizer` (step count ``t`` after the increment, gradient ``g = grad + wd * p``)::

    if t < warmup_steps:    m <- b1 m + (1 - b1) g,    v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

During the warmup it is torch's Adam (the same operations, bit for bit) on gradients that
:class:`QAdamAlgorithm` averages over the ranks in full precision. Once ``warmup_steps`` steps are
done, the algorithm resets (rank 0's parameters and state broadcast again) and from then on, after
each backward, updates every rank's momentum from its local gradient and averages the momentum
in 8 bits (ByteGrad's ``minmax_uint8``)::

    m <- Q(mean_r Q(b1 m[r] + (1 - b1) g[r]))

while the optimizer leaves ``m`` and the variance ``v`` (frozen) alone. As in Bagua, the step
numbered ``warmup_steps`` itself updates neither moment, and weight decay has no effect after the
warmup (it only entered the gradient that no longer updates the moments).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

from functional_bagua.compat.algorithms.base import Algorithm, AlgorithmImpl, engine_on_demand
from functional_bagua.compat.algorithms.gradient_allreduce import GradientAllReduceAlgorithmImpl
from functional_bagua.compat.bucket import BaguaBucket  # noqa: F401  # Bagua's module exports it
from functional_bagua.compat.communication import BaguaProcessGroup
from functional_bagua.compat.tensor import BaguaTensor  # noqa: F401  # Bagua's module exports it
from functional_bagua.distributed import buckets as bucketing
from functional_bagua.distributed import compression as codecs
from functional_bagua.distributed.allreduce import reduce_in_buckets
from functional_bagua.distributed.process_group import resolve

if TYPE_CHECKING:
    from functional_bagua.compat.bagua_module import BaguaDistributedDataParallel

__all__ = ["QAdamOptimizer", "QAdamAlgorithm", "QAdamAlgorithmImpl"]


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with a warmup, then frozen variance and externally averaged momentum (module docstring).

    Args:
        params: the parameters (or param groups).
        lr: the learning rate.
        warmup_steps: the steps of plain Adam (``> 0``).
        betas: ``(b1, b2)``.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient (during the warmup).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not isinstance(warmup_steps, int) or warmup_steps <= 0:
            raise ValueError(f"warmup_steps must be an int > 0, got {warmup_steps!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps

    def steps_taken(self) -> int:
        """The step count of the first parameter with state (0 before the first step)."""
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state.get(p, {}):
                    return int(self.state[p]["step"])
        return 0

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"].item()
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if t < self.warmup_steps:
                    grad = p.grad if group["weight_decay"] == 0 else p.grad.add(p, alpha=group["weight_decay"])
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = group["lr"] / (1 - beta1**t)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**t) ** 0.5).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


class QAdamAlgorithmImpl(AlgorithmImpl):
    """Full-precision gradient averaging during the warmup, 8-bit momentum averaging after it
    (module docstring).

    Args:
        process_group: the group to average over.
        q_adam_optimizer: the :class:`QAdamOptimizer` of the wrapped model.
        hierarchical: accepted for Bagua's scripts; the averaging is flat over all ranks.
    """

    def __init__(
        self, process_group: BaguaProcessGroup, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True
    ) -> None:
        super().__init__(process_group)
        self.optimizer, self.hierarchical = q_adam_optimizer, hierarchical
        self.warmup = GradientAllReduceAlgorithmImpl(process_group)
        self.compressing = False

    def need_reset(self) -> bool:
        return not self.compressing and self.optimizer.steps_taken() == self.optimizer.warmup_steps

    def init(self, ddp: "BaguaDistributedDataParallel") -> None:
        if ddp.bagua_optimizers != [self.optimizer]:
            raise ValueError("QAdamAlgorithm: wrap the model with the QAdamOptimizer given to the algorithm, alone")
        if self.optimizer.steps_taken() >= self.optimizer.warmup_steps:
            self.compressing = True
        else:
            self.warmup.init(ddp)

    def set_gradient_sync(self, enabled: bool) -> None:
        self.warmup.set_gradient_sync(enabled)

    def detach(self, ddp: "BaguaDistributedDataParallel") -> None:
        self.warmup.detach(ddp)

    @torch.no_grad()
    def after_backward(self, ddp: "BaguaDistributedDataParallel") -> None:
        if not self.compressing:
            return
        g = resolve(self.process_group.torch_group, "QAdamAlgorithm")
        moments = []
        for pg in self.optimizer.param_groups:
            beta1 = pg["betas"][0]
            for p in pg["params"]:
                if p.grad is None:
                    continue
                m = self.optimizer.state[p]["exp_avg"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                moments.append(m)
        caps = bucketing.bucket_caps(ddp.bucket_cap_mb, "QAdamAlgorithm")
        for m, averaged in zip(moments, reduce_in_buckets(moments, caps, g, True, "minmax_uint8")):
            m.copy_(averaged)

    def buckets(self) -> list:
        return self.warmup.buckets()

    def bytes_per_step(self, ddp: "BaguaDistributedDataParallel") -> int:
        if self.compressing:
            n = torch.distributed.get_world_size(self.process_group.torch_group)
            numel = sum(p.numel() for _, p in ddp.named_parameters_to_sync())
            return codecs.payload_bytes(numel, 4, n, "minmax_uint8")
        return self.warmup.bytes_per_step(ddp)


class QAdamAlgorithm(Algorithm):
    """QAdam's communication (module docstring; Bagua's signature).

    Args:
        q_adam_optimizer: the :class:`QAdamOptimizer` of the model to wrap.
        hierarchical: accepted for Bagua's scripts; the averaging is flat over all ranks.
    """

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True) -> None:
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(f"QAdamAlgorithm needs a QAdamOptimizer, got {type(q_adam_optimizer).__name__}")
        self.optimizer, self.hierarchical = q_adam_optimizer, hierarchical

    def reify(self, process_group: BaguaProcessGroup) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, self.optimizer, self.hierarchical)


__getattr__ = engine_on_demand(__name__)  # Bagua's module exports BaguaDistributedDataParallel
