"""The small numeric helpers every transform uses: step counts, float64 scalars, and updates
written so that a hyperparameter may be a Python number or a 0-dim tensor.

Scalar math (bias corrections, step sizes) runs in float64, like torch.optim's Python floats:
:data:`SCALAR_DTYPE` is the one place that says so. A 0-dim tensor does not promote the tensors
it multiplies, so a float32 parameter's update stays float32.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from functional_bagua import foreach, tree

if TYPE_CHECKING:
    from typing_extensions import TypeIs

COUNT_DTYPE = torch.int64
SCALAR_DTYPE = torch.float64


# the state types whose transforms take their 0-dim scalars (step counts, float64 numbers) on the
# CPU beside tensors on another device: fb.Optimizer's eager step keeps those there
_CPU_SCALARS_TAKEN: set[type] = set()


def takes_cpu_scalars(state_type: type) -> type:
    """Declare that the transform whose state is a ``state_type`` computes as well with the 0-dim
    scalars of that state (its step counts, its float64 numbers) on the CPU as on its tensors'
    device: its tensors' ops take them as numbers (``foreach``), and none of its ops would refuse
    a 0-dim CPU operand beside tensors on a GPU. ``fb.Optimizer``'s eager step then holds them
    there, as torch.optim holds its ``step`` (:func:`takes_cpu_scalars_in`).

    Args:
        state_type: the NamedTuple class of the transform's state.

    Returns:
        ``state_type``, so that this may decorate its definition.
    """
    _CPU_SCALARS_TAKEN.add(state_type)
    return state_type


def takes_cpu_scalars_in(state: Any) -> bool:
    """Whether ``state`` is of a type declared with :func:`takes_cpu_scalars`."""
    return type(state) in _CPU_SCALARS_TAKEN


def zero_count(like: tree.PyTree) -> torch.Tensor:
    """A 0-dim integer step counter on the device of ``like`` (a tensor, or a tree of them).

    Args:
        like: a tensor, or a tree of tensors (its first tensor leaf gives the device).

    Returns:
        A 0-dim int64 tensor holding 0.
    """
    device = like.device if isinstance(like, torch.Tensor) else tree.device_of(like)
    return torch.zeros((), dtype=COUNT_DTYPE, device=device)


def read_counts(counts: list) -> list[int]:
    """The values of 0-dim integer tensors as Python ints, read with one copy (and one sync)
    per device rather than one per tensor.

    Args:
        counts: 0-dim tensors, on any devices.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, c in enumerate(counts):
        by_device.setdefault(c.device, []).append(i)
    values = [0] * len(counts)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([counts[i] for i in indices]).tolist()):
            values[i] = int(value)
    return values


def as_scalar(count: torch.Tensor) -> torch.Tensor:
    """A count as a 0-dim float64 tensor, for scalar hyperparameter math.

    Scalar math (bias corrections, step sizes) runs in float64 like torch.optim's Python floats;
    a 0-dim tensor does not promote the tensors it multiplies, so a float32 parameter's update
    stays float32.

    Args:
        count: an integer step count tensor (as :func:`zero_count` makes).

    Returns:
        ``count`` converted to float64.
    """
    return count.to(SCALAR_DTYPE)


def holds_scalar_tensors(x: object) -> bool:
    """Whether ``x`` is a 0-dim tensor, or :class:`~functional_bagua.foreach.Leaves` holding one.

    Args:
        x: a tensor, or the ``Leaves`` a grouped rule gets in its place.
    """
    if isinstance(x, foreach.Leaves):
        return any(t.dim() == 0 for t in x.items)
    return isinstance(x, torch.Tensor) and x.dim() == 0


def is_number(x: object) -> TypeIs[float]:
    """A Python number (a hyperparameter fixed at build time), as opposed to a tensor.

    Args:
        x: any value, typically a hyperparameter.

    Returns:
        ``True`` for an ``int`` or ``float`` that is not a ``bool``, else ``False``.
    """
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_real_number(x: object) -> bool:
    """A real number, numpy's included (``numbers.Real``), not a bool.

    Args:
        x: any value, typically a hyperparameter as a user gave it.
    """
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def holds_tensor(value: object) -> bool:
    """Whether ``value`` is a tensor, or a tuple or list holding one (``betas``).

    Args:
        value: a hyperparameter.
    """
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def lerp(start: torch.Tensor, end: torch.Tensor, weight: Union[float, torch.Tensor]) -> torch.Tensor:
    """``start + weight * (end - start)``; ``weight`` a number or a 0-dim tensor (any dtype).

    Args:
        start: the value at ``weight = 0`` (left unmodified).
        end: the value at ``weight = 1``, of ``start``'s shape.
        weight: the interpolation weight; a tensor is first cast to ``start``'s dtype.

    Returns:
        A new tensor.
    """
    return start.lerp(end, lerp_weight(weight, start))


def lerp_weight(weight: Union[float, torch.Tensor], start: Any) -> Union[float, torch.Tensor]:
    """``weight`` as :func:`lerp` hands it to ``torch.lerp``: a number as it is, a tensor in the
    dtype of ``start`` (for ``foreach.updated(start, "lerp", end, lerp_weight(weight, start))``,
    :func:`lerp` computed in ``start``'s memory).

    Args:
        weight: the interpolation weight, a number or a 0-dim tensor.
        start: the tensor (or ``foreach.Leaves``) interpolated from.
    """
    return weight if is_number(weight) else weight.to(start.dtype)


def add_scaled(x: torch.Tensor, y: torch.Tensor, alpha: Union[float, torch.Tensor]) -> torch.Tensor:
    """``x + alpha * y``; ``alpha`` a number (one fused kernel) or a 0-dim tensor.

    Args:
        x: the tensor added to (left unmodified).
        y: the tensor scaled and added.
        alpha: the scale of ``y``.

    Returns:
        A new tensor.
    """
    return x.add(y, alpha=alpha) if is_number(alpha) else x + alpha * y


def filled_like(p: torch.Tensor, value: Union[float, complex, torch.Tensor]) -> torch.Tensor:
    """A tensor like ``p`` filled with ``value`` (a number or a 0-dim tensor), in ``p``'s dtype.

    Args:
        p: the tensor whose shape, dtype and device the result takes.
        value: the fill value.

    Returns:
        A new tensor.
    """
    return torch.full_like(p, value) if is_number(value) else torch.zeros_like(p).add_(value)


def readable_now(value: Any) -> bool:
    """Whether the one-element tensor ``value`` may be read as a Python number now: on the CPU
    (reading waits for no device), eagerly (not traced by torch.compile or torch.jit), and
    outside any differentiation through it (autograd records it, or a torch.func transform
    such as ``grad`` or ``vmap`` wraps it): there the number would cut the derivative, so the
    tensor is used as it is.

    Args:
        value: a tensor.
    """
    return (
        value.numel() == 1
        and value.device.type == "cpu"
        and not value.requires_grad
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not torch._C._functorch.is_functorch_wrapped_tensor(value)
    )


def number_now(value: Any) -> Optional[float]:
    """``value`` as a Python number where reading it waits for no device: a number as it is, and
    eagerly a one-element CPU tensor (``fb.Optimizer``'s factory form holds its hyperparameters
    so on the CPU); ``None`` while traced and for a tensor on a device, which the step then
    reads as data (a matmul's ``beta`` and ``alpha`` would read it back to the host). Unlike
    :func:`eager_number` it is not rounded to any dtype first: for an op that takes the number
    itself, as the alias built with it gives it.

    Args:
        value: a hyperparameter: a number or a tensor.
    """
    if is_number(value):
        return value
    if isinstance(value, torch.Tensor) and readable_now(value):
        return value.item()
    return None


def eager_number(x: Any, like: Any) -> Optional[float]:
    """A 0-dim CPU hyperparameter ``x`` (``fb.Optimizer``'s factory form and ``inject_hyperparams``
    hold them so) as a Python number when running eagerly beside float32 or float64 tensors
    ``like`` (a tensor, or ``foreach.Leaves`` of one device, on any device): its value rounded
    to their dtype first, as a single-tensor op rounds a scalar operand, read without waiting
    for any device (as ``foreach`` reads lerp weights). A rule then takes the number's path: a
    fused ``alpha``, or no term at all where it is 0 (as torch.optim's ``if weight_decay !=
    0``). ``None`` while traced, for a tensor held on a device, beside other dtypes, or for
    anything but such a tensor. (Unlike
    ``foreach._cpu_number``, which keeps the tensor beside 0-dim tensors of a group, it decides
    per tensor's dtype alone, so a rule takes the same path grouped and one tensor at a time.)

    Args:
        x: the hyperparameter.
        like: the tensors it is applied to.
    """
    if (
        isinstance(x, torch.Tensor)
        and x.dim() == 0
        and x.is_floating_point()
        and readable_now(x)
        and _reads_numbers_beside(like)
    ):
        return x.to(like.dtype).item()
    return None


def _reads_numbers_beside(like: Any) -> bool:
    """Whether :func:`eager_number` reads a CPU tensor as a number beside ``like``: eagerly, beside
    float32 or float64 tensors (on the CPU, or on a GPU beside the scalars ``fb.Optimizer``
    holds on the CPU: its kernels take a number in the tensors' dtype too)."""
    return getattr(like, "dtype", None) in (torch.float32, torch.float64) and not torch.compiler.is_compiling()


def eager_numbers(values: Sequence[Any], like: Any) -> Optional[list[float]]:
    """Each of ``values`` (numbers, 0-dim CPU tensors such as bias corrections computed from a
    step count, or ``foreach.Leaves`` of such tensors, one per tensor of ``like``) as a Python
    number, a tensor read as :func:`eager_number` reads it; ``None`` unless every one is a
    number now (traced, held on a device, beside other dtypes). A rule given numbers may compute in
    its own temporaries (``x.div_(c)``: a number never promotes them, so in place and out of
    place give the same dtype and bits) and fuse a factor into an ``alpha`` or a ``value``.

    Per-tensor scalars that differ between the tensors of a group (counts of tensors stepped
    unequally often) raise :class:`~functional_bagua.foreach.PerTensorOnly`: the rule then runs
    one tensor at a time, each with its own numbers, so it takes the same path, and gives the
    same bits, grouped and alone. Call it before the rule overwrites any state.

    Args:
        values: the factors.
        like: the tensors they are applied to.
    """
    out = []
    for value in values:
        if isinstance(value, foreach.Leaves):
            if not _reads_numbers_beside(like):
                return None  # no tensor is read as a number beside these: no need to compare them
            value = _the_one_value(value)
        number = value if is_number(value) else eager_number(value, like)
        if number is None:
            return None
        out.append(number)
    return out


def _the_one_value(scalars: "foreach.Leaves") -> Any:
    """The first of per-tensor 0-dim CPU tensors where all hold the same bits (a PerTensorOnly
    error where they differ); ``scalars`` as they are where they are not such tensors."""
    items = scalars.items
    if not items or any(t.dim() != 0 or t.device.type != "cpu" or t.dtype != items[0].dtype for t in items):
        return scalars
    if torch.compiler.is_compiling():
        return scalars
    foreach.values_read()  # a number from these tensors: the operations recorded now are theirs
    if not foreach.same_bits(items):
        raise foreach.PerTensorOnly("per-tensor scalars that differ between the tensors: one tensor at a time")
    return items[0]
