"""Learning-rate-free Adam: the step size ``d`` estimated from the gradients and the distance
travelled, so that ``lr`` stays 1 (Defazio & Mishchenko, 2023, "Learning-Rate-Free Learning by
D-Adaptation"; Mishchenko & Defazio, 2024, "Prodigy"), as the authors' ``dadaptation`` and
``prodigyopt`` packages compute them.

Both keep ``d`` and its running sums in the state (one number for all the tensors), each tensor's
moments, and an accumulator ``s`` of the steps' gradients; ``d`` only grows. With ``k`` the
steps taken and ``bc = sqrt(1 - b2^(k+1)) / (1 - b1^(k+1))`` (1 without bias correction),
``dlr = d lr bc``; sums run over every coordinate of every tensor.

Prodigy (``b3 = sqrt(b2)`` by default; ``p0``: the parameters at the first step)::

    r_k   = b3 r_{k-1} + (d / d0) dlr <g, p0 - p>
    m     = b1 m + d (1 - b1) g                  v = b2 v + d^2 (1 - b2) g^2
    s     = b3 s + (d / d0) dlr g                ((d / d0) d g with safeguard_warmup)
    d_hat = d_coef r_k / sum|s|
    d    <- max(d, d_hat) at the first estimate;   d_max = max(d_max, d_hat);   d <- min(d_max, d growth_rate)
    u     = dlr (m / (sqrt(v) + d eps) + weight_decay p)         (d: the new one; dlr: this step's)

D-Adaptation Adam (``sb = sqrt(b2)``)::

    a_k   = sb a_{k-1} + (1 - sb) dlr <g, s / (sqrt(v) + eps)>   (s and v before this step)
    m     = b1 m + dlr (1 - b1) g                v = b2 v + (1 - b2) g^2
    s     = sb s + dlr (1 - sb) g
    d    <- max(d, min(a_k / ((1 - sb) sum|s|), d growth_rate))
    u     = m / (sqrt(v) + eps) + dlr weight_decay p

A step whose ``sum|s|`` is 0 (every gradient so far 0) updates the moments and ``s`` and moves
nothing else, as the references return early. ``u`` is the step itself (``lr`` and ``d`` are in
it): the aliases finish with ``scale(-1)``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from functional_bagua import accepted, checks, foreach, layout_context, ownership, tree
from functional_bagua.accepted import AcceptedStep
from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import SCALAR_DTYPE, as_scalar, eager_numbers, is_number, number_now, zero_count
from functional_bagua.tree import PyTree

Scalar = Union[float, torch.Tensor]


class ProdigyState(NamedTuple):
    """``count`` (steps taken), ``d``, ``d_max``, ``d_numerator`` (``r_k``): one each, float64;
    per tensor: ``mu`` and ``nu`` (moments, scaled by ``d``), ``s``, ``p0`` (the starting
    parameters)."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    d: torch.Tensor
    d_max: torch.Tensor
    d_numerator: torch.Tensor
    mu: PyTree
    nu: PyTree
    s: PyTree
    p0: PyTree


class DadaptAdamState(NamedTuple):
    """``count``, ``d`` and ``numerator`` (``a_k``): one each, float64; per tensor: ``mu`` (first
    moment, scaled by ``dlr``), ``nu`` (second moment), ``s``."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    d: torch.Tensor
    numerator: torch.Tensor
    mu: PyTree
    nu: PyTree
    s: PyTree


def _scalar(value: float, like: PyTree) -> torch.Tensor:
    return torch.full((), value, dtype=SCALAR_DTYPE, device=tree.device_of(like))


def _zeros_or_none(leaves: list) -> list:
    return [None if p is None else torch.zeros_like(p) for p in leaves]


def _total(values: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The float64 sum of 0-dim tensors (on any devices), on ``device``; 0 for none."""
    if not values:
        return torch.zeros((), dtype=SCALAR_DTYPE, device=device)
    if all(v.device == values[0].device and v.dtype == values[0].dtype for v in values):  # one conversion
        return torch.stack(values).to(device=device, dtype=SCALAR_DTYPE).sum()
    return torch.stack([v.to(device=device, dtype=SCALAR_DTYPE) for v in values]).sum()


def _factor(x: Union[float, torch.Tensor], like: torch.Tensor) -> Union[float, torch.Tensor]:
    """A float64 scalar factor on ``like``'s device and in its dtype: the product with ``like``
    then keeps ``like``'s dtype also for a 0-dim ``like`` (two 0-dim tensors would promote), to
    the bits of a Python-number factor."""
    return x.to(device=like.device, dtype=like.dtype) if isinstance(x, torch.Tensor) else x


def _stepping(lr: Scalar) -> Optional[torch.Tensor]:
    """Whether a step with this ``lr`` moves anything (the references skip a step at lr 0), as a
    0-dim bool tensor; ``None`` for a Python number above 0 (it does)."""
    if isinstance(lr, torch.Tensor):
        return lr > 0
    return None if lr > 0 else torch.tensor(False)


def _kept_unless(stepping: Optional[torch.Tensor], new: Any, old: Any) -> Any:
    return new if stepping is None or new is None else torch.where(stepping.to(new.device), new, old)


def _dot_with_difference(g: Any, p0: Any, p: Any) -> Any:
    """``<g, p0 - p>`` of one tensor (or of each of a group's)."""
    return torch.dot(g.reshape(-1), (p0 - p).reshape(-1))


def _l1_norm(x: Any) -> Any:
    """``sum |x|`` of one tensor (or of each of a group's)."""
    return x.abs().sum()


def _decayed_plus(old: Any, decay: Scalar, added: Any) -> Any:
    """``old * decay + added`` (``decay`` in ``added``'s dtype), the new value of the state tensor
    ``old``: computed in it where its caller gave it up (:func:`~functional_bagua.foreach.updated`)."""
    return foreach.updated(old, "mul", _factor(decay, added)).add_(added)


def _moments_with_numbers(g: Any, olds: tuple, decays: tuple, factors: tuple, squared: tuple) -> Optional[tuple]:
    """``old * decay + factor * g`` (``g * g`` where ``squared``) for each ``old`` of ``olds``, as
    the references write them (``mu.mul_(b1).add_(g, alpha=...)``, ``nu.mul_(b2).addcmul_(g, g,
    value=...)``), in the old tensors where their caller gave them up, eagerly, where every
    decay and factor is a number now (:func:`~functional_bagua.numerics.eager_numbers`, read
    before anything is overwritten); else ``None``."""
    numbers = eager_numbers((*decays, *factors), g)
    if numbers is None:
        return None
    n = len(olds)
    out = []
    for old, decay, factor, square in zip(olds, numbers[:n], numbers[n:], squared):
        kept = foreach.updated(old, "mul", decay)
        out.append(kept.addcmul_(g, g, value=factor) if square else kept.add_(g, alpha=factor))
    return tuple(out)


def _writes_in_place(lr: Scalar, g_leaves: list, p_leaves: list, *fields: list) -> bool:
    """Whether a step may be written into the parameters and the state's fields
    (``apply_in_place``): eagerly, ``lr`` a number, and the tensors of the gradients given, of
    their parameters and fields float32 or float64 CPU tensors that
    :func:`~functional_bagua.foreach.writable_in_place` allows (every factor of the step then a
    Python number, :func:`~functional_bagua.numerics.eager_numbers`)."""
    if not (is_number(lr) and lr > 0) or torch.compiler.is_compiling():
        return False
    stepped = [i for i, g in enumerate(g_leaves) if g is not None]
    tensors = [column[i] for column in (g_leaves, p_leaves, *fields) for i in stepped]
    return foreach.writable_in_place(tensors) and tensors[0].device.type == "cpu"


def _host_numbers(*values: Any) -> list[float]:
    """The factors of a step written in place (:func:`_writes_in_place`: all numbers or CPU
    scalars) as the Python numbers the references compute, unrounded."""
    numbers = [number_now(v) for v in values]
    assert all(n is not None for n in numbers)  # _writes_in_place
    return numbers  # type: ignore[return-value]


def _update_of(name: str, shaped: Callable[[Any], PyTree], lr: Scalar, run: Callable[..., tuple]) -> Callable:
    """The ``update`` of a learning-rate-free transform (its state's fields ``mu``, ``nu`` and
    ``s``, its structure that of ``shaped(state)``) from ``run(g_leaves, p_leaves, spec, state,
    alpha) -> (updates, new state)``, with ``update.apply_in_place(grads, state, params,
    alpha)``: ``p <- p + alpha u`` written into ``params`` and the state's moments (both given
    up by the caller) as the reference writes them (``p.addcdiv_(mu, denom, value=-dlr)``), or
    ``None``, nothing changed, where :func:`_writes_in_place` says no or a ``scaled_by`` is
    given (the rule decays the parameters itself)."""

    def checked(grads: PyTree, state: Any, params: Optional[PyTree]) -> tuple:
        spec = tree.flatten(shaped(state))[1]
        return (*_check_inputs(name, grads, params, spec), spec)

    def update(grads: PyTree, state: Any, params: Optional[PyTree] = None) -> tuple[PyTree, Any]:
        g_leaves, p_leaves, spec = checked(grads, state, params)
        updates, new_state = run(g_leaves, p_leaves, spec, state, None)
        return spec.unflatten(updates), new_state

    def apply_in_place(
        grads: PyTree, state: Any, params: PyTree, alpha: float, scaled_by: Optional[float] = None
    ) -> Optional[Any]:
        if scaled_by is not None or not (is_number(lr) and lr > 0):
            return None  # its own decay only; the references skip a step at lr 0
        records = accepted.records_now()
        leaves = _accepted_leaves(records, name, grads, state, params)
        if leaves is None:  # the checks (and where they pass, a record of what they accepted)
            g_leaves, p_leaves, spec = checked(grads, state, params)
            moments = [_leaves(spec, x) for x in (state.mu, state.nu, state.s)]
            if not _writes_in_place(lr, g_leaves, p_leaves, *moments):
                return None
        else:
            g_leaves, p_leaves, spec = leaves
        with ownership.giving_state(update):
            new_state = run(g_leaves, p_leaves, spec, state, alpha)[1]
        if records is not None:
            _remember(records, name, spec, g_leaves, p_leaves, moments if leaves is None else None, new_state)
        return new_state

    update.apply_in_place = apply_in_place  # type: ignore[attr-defined]
    update.needs_params = True  # type: ignore[attr-defined]  # a chain passes them on
    update.takes_a_step = name  # type: ignore[attr-defined]  # its updates hold the step size (direction.py)
    return update


def _accepted_leaves(
    records: Optional[dict], name: str, grads: PyTree, state: Any, params: PyTree
) -> Optional[tuple[list, list, Any]]:
    """The leaves of ``grads`` and ``params`` and the state's structure, where the last step's
    checks accepted these inputs (``records[(name, "written")]``,
    :func:`~functional_bagua.accepted.kept_inputs`: the state the step returned, its moments
    stepped in place); else ``None``."""
    record = records.get((name, "written")) if records is not None else None
    if record is None:
        return None
    layout_context.refuse_on_shards(name, "its step size d sums over every coordinate of every tensor")
    spec = record.spec
    g_leaves = tree.leaves_up_to(spec, grads, "the gradients", "the parameters")
    p_leaves = tree.leaves_up_to(spec, params, "the parameters", "the state")
    if accepted.kept_inputs(records, (name, "written"), spec, g_leaves, p_leaves, state) is None:
        return None
    return g_leaves, p_leaves, spec


def _remember(
    records: dict, name: str, spec: Any, g_leaves: list, p_leaves: list, moments: Optional[list], new_state: Any
) -> None:
    """What the checks of a step written into the parameters accepted (``moments``: the old
    moments' leaves, after the checks), or where the step ran on a record (``moments`` ``None``),
    the record kept for the new state where the step stepped the same moments in place; none
    kept where it did not step them in place."""
    present = [i for i, g in enumerate(g_leaves) if g is not None]
    after = [_leaves(spec, x) for x in (new_state.mu, new_state.nu, new_state.s)]
    if moments is None:
        record = records.pop((name, "written"))
        kept = all(
            a is b
            for column, leaves in zip(record.columns, after)
            for a, b in zip(column, (leaves[i] for i in present))
        )
        if kept:
            record.state = new_state
            records[(name, "written")] = record
        return
    record = AcceptedStep.after(
        spec,
        [g is not None for g in g_leaves],
        [g_leaves[i] for i in present],
        [p_leaves[i] for i in present],
        [[leaves[i] for i in present] for leaves in moments],
        new_state,
        [[leaves[i] for i in present] for leaves in after],
    )
    if record is not None:
        records[(name, "written")] = record


def _leaves(spec: Any, field: PyTree) -> list[Any]:
    """A per-tensor field of the state as the list of its tensors (``None`` where none)."""
    return list(spec.flatten_up_to(field))


def _bias_correction(count: torch.Tensor, b1: Scalar, b2: Scalar, enabled: bool) -> Union[float, torch.Tensor]:
    if not enabled:
        return 1.0
    k1 = as_scalar(count) + 1
    return (1 - b2**k1).sqrt() / (1 - b1**k1)


def _check_params(params: PyTree, name: str) -> None:
    """Trainable real tensors (the estimate's dot products and squares are those of real numbers)."""
    leaves, spec = tree.flatten(params)
    for i, p in enumerate(leaves):
        if p is not None:
            checks.check_param(p, functools.partial(tree.leaf_name, spec, i), name, complex_ok=False)


def _check_inputs(name: str, grads: PyTree, params: Optional[PyTree], spec: Any) -> tuple[list, list]:
    """The leaves of ``grads`` and ``params`` (both of the state's structure ``spec``), each
    gradient checked against its parameter; a sharded run refused (``d`` sums over all of them)."""
    if params is None:
        raise ValueError(f"{name} needs the parameters: call update(grads, state, params)")
    # inside shard(), shard_by_tensor() and fused over FSDP2's local shards alike
    layout_context.refuse_on_shards(name, "its step size d sums over every coordinate of every tensor")
    g_leaves = tree.leaves_up_to(spec, grads, "the gradients", "the parameters")
    p_leaves = tree.leaves_up_to(spec, params, "the parameters", "the state")
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        if g is not None:
            checks.check_grad(g, p, functools.partial(tree.leaf_name, spec, i), name)
    return g_leaves, p_leaves


def scale_by_prodigy(
    lr: Scalar = 1.0,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    b3: Optional[Scalar] = None,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    use_bias_correction: bool = False,
    safeguard_warmup: bool = False,
    d0: float = 1e-6,
    d_coef: Scalar = 1.0,
    growth_rate: Scalar = math.inf,
) -> GradientTransformation:
    """Prodigy's step (module docstring), ``d`` estimated in the state.

    Args:
        lr: a multiplier of the estimated step (1 in the reference's advice; a schedule works).
        b1: the decay rate of the first moment (0: none kept, the gradient used).
        b2: the decay rate of the second moment.
        b3: the decay rate of ``r`` and ``s`` (``None``: ``sqrt(b2)``).
        eps: added to the root of the second moment, times ``d``.
        weight_decay: decoupled weight decay, ``dlr * weight_decay * p``.
        use_bias_correction: Adam's bias correction in ``dlr``.
        safeguard_warmup: ``s`` accumulates ``(d / d0) d g`` instead of ``(d / d0) dlr g`` (no
            ``lr`` in the denominator during a warmup).
        d0: the initial estimate of ``d``.
        d_coef: a multiplier of every new estimate ``d_hat``.
        growth_rate: the largest factor ``d`` may grow by in one step.

    Returns:
        A GradientTransformation that needs ``params``; its state is a :class:`ProdigyState`.

    Example::

        tx = fb.chain(fb.scale_by_prodigy(), fb.scale(-1.0))
    """
    beta3 = b2**0.5 if b3 is None else b3
    without_momentum = is_number(b1) and b1 == 0  # the reference keeps no first moment then

    def init(params: PyTree) -> ProdigyState:
        _check_params(params, "scale_by_prodigy")
        leaves, spec = tree.flatten(params)
        mu, nu, s = (spec.unflatten(_zeros_or_none(leaves)) for _ in range(3))  # three tensors each, none shared
        p0 = spec.unflatten([None if p is None else p.detach().clone() for p in leaves])
        return ProdigyState(
            zero_count(params), _scalar(d0, params), _scalar(d0, params), _scalar(0.0, params), mu, nu, s, p0
        )

    def run(g_leaves: list, p_leaves: list, spec: Any, state: ProdigyState, alpha: Optional[float]) -> tuple:
        """The updates (a list) and the new state; with ``alpha``, ``p <- p + alpha u`` written
        into the parameters instead (:func:`_update_of`), and no updates."""
        mus, nus, ss, p0s = (_leaves(spec, x) for x in (state.mu, state.nu, state.s, state.p0))
        d = state.d
        stepping = _stepping(lr)
        dlr = d * lr * _bias_correction(state.count, b1, b2, use_bias_correction)
        stepped = [i for i, g in enumerate(g_leaves) if g is not None]
        dots = foreach.run_each(_dot_with_difference, [g_leaves, p0s, p_leaves], stepped)
        d_numerator = state.d_numerator * beta3 + (d / d0) * dlr * _total(list(dots.values()), d.device)
        accumulate = (d / d0) * (d if safeguard_warmup else dlr)

        def moments(g: Any, mu: Any, nu: Any, s: Any) -> tuple:
            if stepping is None:  # eagerly with numbers: the reference's fused forms
                fused = _moments_with_numbers(
                    g, (mu, nu, s), (b1, b2, beta3), (d * (1 - b1), d * d * (1 - b2), accumulate), (False, True, False)
                )
                if fused is not None:
                    return fused
            return (
                _kept_unless(stepping, _decayed_plus(mu, b1, g * _factor(d * (1 - b1), g)), mu),
                _kept_unless(stepping, _decayed_plus(nu, b2, g * g * _factor(d * d * (1 - b2), g)), nu),
                _kept_unless(stepping, _decayed_plus(s, beta3, g * _factor(accumulate, g)), s),
            )

        new_mu, new_nu, new_s = list(mus), list(nus), list(ss)
        given = (1, 2, 3) if stepping is None and ownership.state_given_to(update) else ()
        for i, (mu, nu, s) in foreach.run_each(moments, [g_leaves, mus, nus, ss], stepped, given).items():
            new_mu[i], new_nu[i], new_s[i] = mu, nu, s
        d_denom = _total(list(foreach.run_each(_l1_norm, [new_s], stepped).values()), d.device)
        active = d_denom > 0  # else nothing moves (the references return early)
        if stepping is not None:
            active = active & stepping.to(active.device)
        d_hat = d_coef * d_numerator / torch.where(active, d_denom, 1.0)
        first = torch.where(d == d0, torch.maximum(d, d_hat), d)
        d_max = torch.maximum(state.d_max, d_hat)
        new_d = torch.minimum(d_max, first * growth_rate)
        step_size = torch.where(active, dlr, 0.0)

        def step(g: Any, mu: Any, nu: Any, p: Any) -> Any:
            momentum = g * _factor(new_d, g) if without_momentum else mu
            numbers = eager_numbers((new_d * eps, weight_decay, step_size), g)
            if numbers is not None:  # eagerly: no decay term at 0 (as the reference), an alpha else
                eps_now, decay_now, step_now = numbers
                direction = momentum / nu.sqrt().add_(eps_now)
                if decay_now != 0:
                    direction.add_(p, alpha=decay_now)
                return direction.mul_(step_now)
            direction = momentum / nu.sqrt().add_(_factor(new_d * eps, g))  # in place on new tensors
            return direction.add_(p * _factor(weight_decay, g)).mul_(_factor(step_size, g))

        def step_into(g: Any, mu: Any, nu: Any, p: Any) -> None:  # as the reference steps p
            eps_now, decay_now, step_now, d_now = _host_numbers(new_d * eps, weight_decay, step_size, new_d)
            assert alpha is not None
            denom = nu.sqrt().add_(eps_now)
            if decay_now != 0:
                p.add_(p, alpha=alpha * step_now * decay_now)
            if without_momentum:
                p.addcdiv_(g, denom, value=alpha * step_now * d_now)
            else:
                p.addcdiv_(mu, denom, value=alpha * step_now)

        updates: list = [None] * len(g_leaves)
        stepped_columns = [g_leaves, new_mu, new_nu, p_leaves]
        for i, u in foreach.run_each(step if alpha is None else step_into, stepped_columns, stepped).items():
            updates[i] = u
        new_state = ProdigyState(
            torch.where(active, state.count + 1, state.count),
            torch.where(active, new_d, d),
            torch.where(active, d_max, state.d_max),
            torch.where(active, d_numerator, state.d_numerator),
            spec.unflatten(new_mu),
            spec.unflatten(new_nu),
            spec.unflatten(new_s),
            state.p0,
        )
        return updates, new_state

    update = _update_of("scale_by_prodigy", lambda state: state.p0, lr, run)
    return GradientTransformation(init, update)


def scale_by_dadapt_adam(
    lr: Scalar = 1.0,
    b1: Scalar = 0.9,
    b2: Scalar = 0.999,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    use_bias_correction: bool = False,
    d0: float = 1e-6,
    growth_rate: Scalar = math.inf,
) -> GradientTransformation:
    """D-Adaptation Adam's step (module docstring), ``d`` estimated in the state.

    Args:
        lr: a multiplier of the estimated step (1 in the reference's advice; a schedule works).
        b1: the decay rate of the first moment.
        b2: the decay rate of the second moment (its root that of ``a`` and ``s``).
        eps: added to the root of the second moment.
        weight_decay: decoupled weight decay, ``dlr * weight_decay * p``.
        use_bias_correction: Adam's bias correction in ``dlr``.
        d0: the initial estimate of ``d``.
        growth_rate: the largest factor ``d`` may grow by in one step.

    Returns:
        A GradientTransformation that needs ``params``; its state is a :class:`DadaptAdamState`.

    Example::

        tx = fb.chain(fb.scale_by_dadapt_adam(), fb.scale(-1.0))
    """
    sqrt_b2 = b2**0.5

    def init(params: PyTree) -> DadaptAdamState:
        _check_params(params, "scale_by_dadapt_adam")
        leaves, spec = tree.flatten(params)
        mu, nu, s = (spec.unflatten(_zeros_or_none(leaves)) for _ in range(3))  # three tensors each, none shared
        return DadaptAdamState(zero_count(params), _scalar(d0, params), _scalar(0.0, params), mu, nu, s)

    def run(g_leaves: list, p_leaves: list, spec: Any, state: DadaptAdamState, alpha: Optional[float]) -> tuple:
        """The updates (a list) and the new state; with ``alpha``, ``p <- p + alpha u`` written
        into the parameters instead (:func:`_update_of`), and no updates."""
        mus, nus, ss = (_leaves(spec, x) for x in (state.mu, state.nu, state.s))
        d = state.d
        stepping = _stepping(lr)
        dlr = d * lr * _bias_correction(state.count, b1, b2, use_bias_correction)
        stepped = [i for i, g in enumerate(g_leaves) if g is not None]

        def dot(g: Any, s: Any, nu: Any) -> Any:
            return torch.dot(g.reshape(-1), (s / nu.sqrt().add_(_factor(eps, s))).reshape(-1))  # add_: a new tensor

        dots = foreach.run_each(dot, [g_leaves, ss, nus], stepped)
        numerator = state.numerator * sqrt_b2 + (1 - sqrt_b2) * (dlr * _total(list(dots.values()), d.device))

        def moments(g: Any, mu: Any, nu: Any, s: Any) -> tuple:
            if stepping is None:  # eagerly with numbers: the reference's fused forms
                fused = _moments_with_numbers(
                    g,
                    (mu, nu, s),
                    (b1, b2, sqrt_b2),
                    (dlr * (1 - b1), 1 - b2, dlr * (1 - sqrt_b2)),
                    (False, True, False),
                )
                if fused is not None:
                    return fused
            return (
                _kept_unless(stepping, _decayed_plus(mu, b1, g * _factor(dlr * (1 - b1), g)), mu),
                _kept_unless(stepping, _decayed_plus(nu, b2, g * g * _factor(1 - b2, g)), nu),
                _kept_unless(stepping, _decayed_plus(s, sqrt_b2, g * _factor(dlr * (1 - sqrt_b2), g)), s),
            )

        new_mu, new_nu, new_s = list(mus), list(nus), list(ss)
        given = (1, 2, 3) if stepping is None and ownership.state_given_to(update) else ()
        for i, (mu, nu, s) in foreach.run_each(moments, [g_leaves, mus, nus, ss], stepped, given).items():
            new_mu[i], new_nu[i], new_s[i] = mu, nu, s
        sk_l1 = _total(list(foreach.run_each(_l1_norm, [new_s], stepped).values()), d.device)
        active = sk_l1 > 0  # else nothing moves (the reference returns early)
        if stepping is not None:
            active = active & stepping.to(active.device)
        d_hat = numerator / ((1 - sqrt_b2) * torch.where(active, sk_l1, 1.0))
        new_d = torch.maximum(d, torch.minimum(d_hat, d * growth_rate))
        decay = dlr * weight_decay

        def step(g: Any, mu: Any, nu: Any, p: Any) -> Any:
            numbers = eager_numbers((eps, decay, active.to(SCALAR_DTYPE)), g)
            if numbers is not None:  # eagerly: no decay term at 0 (as the reference), an alpha else
                eps_now, decay_now, active_now = numbers
                u = mu / nu.sqrt().add_(eps_now)
                if decay_now != 0:
                    u.add_(p, alpha=decay_now)
                return u if active_now == 1 else u.mul_(active_now)
            u = (mu / nu.sqrt().add_(_factor(eps, g))).add_(p * _factor(decay, g))  # in place on new tensors
            return u.mul_(_factor(active.to(SCALAR_DTYPE), g))

        def step_into(g: Any, mu: Any, nu: Any, p: Any) -> None:  # as the reference steps p
            eps_now, decay_now, active_now = _host_numbers(eps, decay, active.to(SCALAR_DTYPE))
            assert alpha is not None
            if active_now != 1:  # the reference returns before: the update, 0 (or NaN where not finite)
                p.add_(step(g, mu, nu, p), alpha=alpha)
                return
            denom = nu.sqrt().add_(eps_now)
            if decay_now != 0:
                p.add_(p, alpha=alpha * decay_now)
            p.addcdiv_(mu, denom, value=alpha)

        updates: list = [None] * len(g_leaves)
        stepped_columns = [g_leaves, new_mu, new_nu, p_leaves]
        for i, u in foreach.run_each(step if alpha is None else step_into, stepped_columns, stepped).items():
            updates[i] = u
        new_state = DadaptAdamState(
            torch.where(active, state.count + 1, state.count),
            torch.where(active, new_d, d),
            torch.where(active, numerator, state.numerator),
            spec.unflatten(new_mu),
            spec.unflatten(new_nu),
            spec.unflatten(new_s),
        )
        return updates, new_state

    update = _update_of("scale_by_dadapt_adam", lambda state: state.s, lr, run)
    return GradientTransformation(init, update)
