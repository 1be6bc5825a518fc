"""Run a rule written for one tensor over many tensors at once, with torch's multi-tensor ops.

A transform's rule is written for one parameter tensor (:func:`~functional_bagua.leafwise`)::

    mu = lerp(s.mu, g, 1 - b1)                   # one tensor

Called with :class:`Leaves` instead of tensors, the same lines run over every tensor of a group
(one device and dtype) at once: ``Leaves`` maps each operation to one ``torch._foreach_*`` call
(out of place, so the update stays pure) where torch has one, and to a loop over the tensors
otherwise::

    mu = lerp(Leaves(mus), Leaves(gs), 1 - b1)   # torch._foreach_lerp(mus, gs, 1 - b1)

This is how torch's ``foreach`` optimizers reach their speed: one call per operation and group
instead of one per operation and tensor. On the CPU, a ``_foreach_*`` op runs the same kernel
on each tensor as the single-tensor op, so both paths give the same bits (tested for every
alias). A rule that needs something only one tensor has (its shape, a Python number from its
values) raises a :class:`PerTensorOnly` error here, and :func:`run_grouped` runs it one tensor at
a time instead. Step counts that every tensor of a group shares (the usual case: all stepped as
often) enter the rule as one tensor, so its scalar arithmetic (bias corrections) runs once per
group; each tensor still gets its own count back. A number (or a 0-dim factor) reaches torch's CPU
multi-tensor ops as a 0-dim tensor of the tensors' dtype, which they convert once rather than
once per tensor, to the same bits (``_scalar_operand``); a 0-dim CPU tensor given to
``lerp``, the clamps, ``maximum`` or ``minimum`` (a weight or a bound computed from the step
count) reaches them as a number, so those run as one multi-tensor op too (``_cpu_number``). On a GPU, where 0-dim counts are
not compared (that would wait for the device), a group's per-tensor scalars (counts, their
bias corrections) are computed together: an elementwise operation on 0-dim tensors only runs
once on them stacked into one vector (``_on_stacked_scalars``), not once per tensor.

:func:`per_tensor` turns the grouped path off in this thread (the reference in the tests, and
what torch.compile traces: inductor fuses the per-tensor ops itself).

Where a list of tensors outgrows the processor's cache, each multi-tensor op reads it back from
memory; torch.optim's for-loop steps keep one tensor in the cache from one op to the next. A rule
may run over slices of its tensors instead, one after the other (:func:`run_in_chunks`): on the
first, the rule itself, its operations on ``Leaves`` recorded (:func:`recorded`, a :class:`Tape`);
on the others those operations again, without the rule's own Python (its scalar arithmetic,
the numbers it reads from step counts). A rule that reads its tensors' values into Python
(:func:`values_read`) runs on each slice itself, and one tensor at a time on a slice where they
differ (:class:`PerTensorOnly`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import struct
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from functional_bagua.checks import read_each

__all__ = [
    "Leaves",
    "OneValue",
    "PerTensorOnly",
    "Tape",
    "grouped_enabled",
    "groups",
    "per_tensor",
    "recorded",
    "run_each",
    "run_in_chunks",
    "run_grouped",
    "run_groups",
    "strict",
    "updated",
    "values_read",
    "writable_in_place",
    "writable_part",
]


class PerTensorOnly(TypeError):
    """A rule asked :class:`Leaves` for something only a single tensor has."""


class _Switch(threading.local):
    def __init__(self) -> None:
        self.per_tensor = 0
        self.strict = 0


_SWITCH = _Switch()


@contextlib.contextmanager
def per_tensor() -> Iterator[None]:
    """Within the block, in this thread, rules run one tensor at a time (the grouped path off).

    Example::

        with fb.foreach.per_tensor():
            updates, state = tx.update(grads, state, params)
    """
    _SWITCH.per_tensor += 1
    try:
        yield
    finally:
        _SWITCH.per_tensor -= 1


@contextlib.contextmanager
def strict() -> Iterator[None]:
    """Within the block, in this thread, a rule that cannot run grouped raises instead of running
    one tensor at a time (to check that a rule runs grouped)."""
    _SWITCH.strict += 1
    try:
        yield
    finally:
        _SWITCH.strict -= 1


def grouped_enabled() -> bool:
    """Whether rules may run grouped: not under :func:`per_tensor`, nor while torch.compile traces."""
    return not _SWITCH.per_tensor and not torch.compiler.is_compiling()


def _items(x: Any, n: int) -> list:
    """``x``'s tensors if it is a :class:`Leaves` (of ``n``), else ``x`` for each of the ``n``."""
    if isinstance(x, Leaves):
        if len(x.items) != n:
            raise ValueError(f"Leaves of {len(x.items)} and {n} tensors in one operation")
        return x.items
    return [x] * n


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _map(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``fn`` on each tensor of the :class:`Leaves` among ``args`` / ``kwargs`` (the others as they are)."""
    n, device = next(
        (len(a.items), a.items[0].device if a.items else None)
        for a in (*args, *kwargs.values())
        if isinstance(a, Leaves)
    )
    if device is not None and device.type != "cpu":
        args, kwargs = _all_on_device(args, kwargs, device)
    stacked = _on_stacked_scalars(fn, args, kwargs, n)
    if stacked is not None:
        return stacked
    columns = [_items(a, n) for a in args]
    named = {k: _items(v, n) for k, v in kwargs.items()}
    results = [fn(*(c[i] for c in columns), **{k: v[i] for k, v in named.items()}) for i in range(n)]
    if all(isinstance(r, torch.Tensor) for r in results):
        return Leaves(results)
    if all(isinstance(r, tuple) for r in results):
        return tuple(Leaves(list(parts)) for parts in zip(*results))
    raise PerTensorOnly(f"{getattr(fn, '__name__', fn)} gives per-tensor values that are not tensors")


def _on_device(x: Any, device: torch.device) -> Any:
    """``x`` on ``device`` where it is a 0-dim CPU tensor (a factor computed from a count held on
    the CPU) beside tensors there: torch's single-tensor ops take a CPU scalar beside GPU tensors
    as a number, but some (the clamps) refuse it; the same value either way."""
    if isinstance(x, torch.Tensor) and x.dim() == 0 and x.device.type == "cpu" and device.type != "cpu":
        return x.to(device, non_blocking=True)  # staged at once: no wait for the device's queue
    return x


def _all_on_device(args: Sequence[Any], kwargs: dict[str, Any], device: torch.device) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each 0-dim CPU tensor on ``device`` (:func:`_on_device`)."""
    return tuple(_on_device(a, device) for a in args), {k: _on_device(v, device) for k, v in kwargs.items()}


def _beside(x: Any, a: "Leaves") -> Any:
    """``x`` for one tensor of ``a`` at a time: on their device where it is a 0-dim CPU tensor and
    they are on a GPU (:func:`_on_device`), as :func:`_map` and a rule run on one tensor take it."""
    return _on_device(x, a.items[0].device) if a.items else x


class ScalarsBeside(torch.overrides.TorchFunctionMode):
    """Within: a torch function given a tensor on ``device`` takes each 0-dim CPU tensor among its
    arguments there (:func:`_on_device`, the same value), while the arithmetic among 0-dim CPU
    tensors alone stays on the CPU. A rule run on one tensor on a GPU, its step count held on the
    CPU (``fb.Optimizer``), so computes its factors on the CPU, as the grouped path does
    (``Leaves`` read them as numbers), and its ops that refuse a CPU operand beside GPU tensors
    (the clamps) take them.

    Args:
        device: the device of the tensors the rule steps (not the CPU).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.device == self.device for a in (*args, *kwargs.values())):
            args, kwargs = _all_on_device(args, kwargs, self.device)
        return func(*args, **kwargs)


# Elementwise functions: on 0-dim tensors stacked into one vector, each element of the result is
# the function of that tensor alone (the same kernel, element by element)
_ELEMENTWISE = {
    *(torch.where, torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne, torch.logical_and, torch.logical_or),
    *(torch.logical_not, torch.isfinite, torch.clamp, torch.clamp_min, torch.clamp_max, torch.maximum, torch.minimum),
    *(torch.add, torch.sub, torch.mul, torch.div, torch.pow, torch.lerp, torch.sqrt, torch.abs, torch.neg, torch.exp),
    *(torch.log, torch.sign, torch.reciprocal, torch.ones_like, torch.zeros_like, torch.full_like, torch.Tensor.to),
    *(torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.__rsub__, torch.Tensor.__rtruediv__, torch.Tensor.__rpow__),
}


def _stacks_scalars(device: torch.device) -> bool:
    """Whether 0-dim tensors on ``device`` are computed stacked (:func:`_on_stacked_scalars`): not
    on the CPU, where an op on a 0-dim tensor costs about a microsecond and a vectorized kernel
    may round a transcendental function (``pow``) otherwise than the scalar one."""
    return device.type != "cpu"


def _on_stacked_scalars(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], n: int
) -> Optional["Leaves"]:
    """``fn`` once over the 0-dim tensors of the :class:`Leaves` among ``args`` / ``kwargs``, each
    stacked into one vector of ``n`` (the result split back into ``n`` 0-dim tensors), where
    ``fn`` is elementwise, grad mode is off (as in ``fb.Optimizer.step``: the results are views of
    one tensor, which autograd would refuse to see modified in place by an op it records), every
    ``Leaves`` holds 0-dim tensors of one dtype on one device where that pays
    (:func:`_stacks_scalars`), and the other operands are numbers or 0-dim tensors there (each
    expanded to ``n``, so types promote as between 0-dim tensors); else ``None``: one op per
    tensor."""
    if fn not in _ELEMENTWISE or torch.is_grad_enabled():  # the views unbind gives: see the docstring
        return None
    operands = (*args, *kwargs.values())
    device = next(a.items[0].device for a in operands if isinstance(a, Leaves) and a.items)
    if not _stacks_scalars(device):
        return None

    def stacked(a: Any) -> Any:
        if isinstance(a, Leaves):
            dtype = a.items[0].dtype
            if any(t.dim() != 0 or t.device != device or t.dtype != dtype or t.requires_grad for t in a.items):
                raise PerTensorOnly("not 0-dim tensors of one dtype and device")
            return torch.stack(a.items)
        if isinstance(a, torch.Tensor):
            if a.dim() != 0 or a.device != device or a.requires_grad:
                raise PerTensorOnly("an operand that is not a 0-dim tensor on the same device")
            return a.expand(n)
        return a

    try:
        result = fn(*(stacked(a) for a in args), **{k: stacked(v) for k, v in kwargs.items()})
    except PerTensorOnly:
        return None
    if not isinstance(result, torch.Tensor) or result.shape != (n,):
        return None
    return Leaves(list(result.unbind()))


_HALF_TYPES = (torch.bfloat16, torch.float16)
_TENSOR_OVERLOAD = {torch._foreach_add, torch._foreach_mul, torch._foreach_div}  # (tensors, 0-dim tensor)


# On the CPU, torch's multi-tensor ops with a number (or a 0-dim tensor of another dtype) convert
# it once per tensor of the list (about 1 us each, more than the arithmetic of a small tensor).
# Given as a 0-dim tensor of the tensors' dtype instead (mul, div), or as a list of it (add, sub:
# broadcast), it is converted once, and the bits are the same for float32 and float64 tensors:
# either way the kernel reads the value rounded once to the tensors' dtype.
_AS_TENSOR = {torch._foreach_mul, torch._foreach_div, torch._foreach_mul_, torch._foreach_div_}
_AS_TENSORS = {torch._foreach_add, torch._foreach_sub, torch._foreach_add_, torch._foreach_sub_}
_CONVERTED_ONCE = (torch.float32, torch.float64)
_TAKES_ONE_TENSOR = {  # the multi-tensor ops with a form for one 0-dim tensor operand
    torch._foreach_add,
    torch._foreach_mul,
    torch._foreach_div,
    torch._foreach_add_,
    torch._foreach_mul_,
    torch._foreach_div_,
}


def _converts_scalars_per_tensor(device: torch.device) -> bool:
    """Whether torch's multi-tensor ops on ``device`` convert a scalar operand once per tensor (the
    CPU's), rather than taking one of the list's dtype whole (a GPU's)."""
    return device.type == "cpu"


def _scalar_operand(foreach: Callable[..., Any], a: "Leaves", b: Any) -> Any:
    """``b`` (a number, or a shared 0-dim tensor: :func:`_is_shared_scalar`) as the operand of
    ``foreach(a.items, ...)`` that gives each tensor the single-tensor op's bits and dtype
    fastest, or ``None`` where the multi-tensor op would not (a 0-dim tensor, which a ``b`` of
    another dtype promotes, and torch's multi-tensor add does not). For float32 and float64
    tensors that autograd records nowhere: on the CPU, a 0-dim tensor of their dtype (or a list
    of it); on a GPU, a 0-dim tensor ``b`` in their dtype (its multi-tensor kernels take a scalar
    tensor of the list's dtype whole, and one of another dtype one tensor at a time); else ``b``
    itself."""
    is_tensor = isinstance(b, torch.Tensor)
    plain = a.plain_dtype() if a.items else None  # no 0-dim tensor, none recorded by autograd: no loop
    if is_tensor and plain is None and any(t.dim() == 0 and t.dtype != b.dtype for t in a.items):
        return None
    as_tensor, as_tensors = foreach in _AS_TENSOR, foreach in _AS_TENSORS
    if (
        not (as_tensor or as_tensors)
        or not a.items
        or is_tensor
        and (b.requires_grad or b.dtype not in _CONVERTED_ONCE)
    ):
        return b
    dtype = a.items[0].dtype
    if dtype not in _CONVERTED_ONCE or plain is None and any(t.dtype is not dtype or t.requires_grad for t in a.items):
        return b
    if not _converts_scalars_per_tensor(a.items[0].device):
        return b.to(dtype) if is_tensor and foreach in _TAKES_ONE_TENSOR else b
    if is_tensor:
        converted = b if b.dtype == dtype else b.to(dtype)
    else:
        converted = _number_as_tensor(b, dtype)
    return converted if as_tensor else [converted] * len(a.items)


_NUMBERS_AS_TENSORS: dict[tuple, torch.Tensor] = {}  # (dtype, the number's exact value) -> its 0-dim tensor


def _number_as_tensor(b: Any, dtype: torch.dtype) -> torch.Tensor:
    """The number ``b`` as a 0-dim CPU tensor of ``dtype`` (an int through int64, rounded once,
    and too large for int64 refused, as the single-tensor op does), made once per value: the
    same tensor for the same bits (``-0.0`` apart from ``0.0``, each NaN its own), read-only operands of the
    multi-tensor ops. At most a few hundred kept (a step's numbers change every step)."""
    key = (dtype, struct.pack("<d", b) if isinstance(b, float) else b)  # every bit: NaN's sign and payload too
    known = _NUMBERS_AS_TENSORS.get(key)
    if known is None:
        if len(_NUMBERS_AS_TENSORS) >= 256:
            _NUMBERS_AS_TENSORS.clear()
        known = torch.tensor(b, dtype=torch.int64 if isinstance(b, int) else dtype, device="cpu").to(dtype)
        _NUMBERS_AS_TENSORS[key] = known
    return known


_READ_AS_NUMBER = {torch._foreach_maximum, torch._foreach_minimum, torch._foreach_clamp_min, torch._foreach_clamp_max}
# beside tensors on a GPU, whose multi-tensor kernels take a number whole (on the CPU these take a
# 0-dim tensor of the tensors' dtype instead: _scalar_operand)
_READ_AS_NUMBER_ON_A_GPU = {*_AS_TENSOR, *_AS_TENSORS}
# CUDA's multi-tensor div by one number multiplies by its reciprocal (as div by a CPU scalar does),
# while a rule run on one tensor divides by the factor taken on the device (ScalarsBeside): a
# factor read from a 0-dim CPU tensor goes to these as a list of the number (the ScalarList form
# divides, one kernel still), so both paths divide
_DIVIDES = {torch._foreach_div, torch._foreach_div_}


def _read_number(foreach: Callable[..., Any], b: Any, a: "Leaves") -> Any:
    """``b`` as :func:`_cpu_number` reads it for ``foreach`` beside ``a`` on a GPU; a division's
    as ``[number] * len(a)`` (:data:`_DIVIDES`)."""
    number = _cpu_number(b, a)
    if foreach in _DIVIDES and number is not b and _is_scalar(number):
        return [number] * len(a.items)
    return number


def _on_a_gpu(a: "Leaves") -> bool:
    """Whether ``a``'s first tensor is on a device other than the CPU."""
    return bool(a.items) and not _converts_scalars_per_tensor(a.items[0].device)


def _cpu_number(b: Any, a: "Leaves") -> Any:
    """``b`` as a Python number where it is a 0-dim floating-point tensor on the CPU beside
    ``a``'s float32 or float64 tensors, on any device (its value read without waiting for any
    device), rounded to their dtype first, as the single-tensor op rounds it: for the ops that
    compute in their input's dtype (``lerp``'s weight, ``clamp``'s bounds, ``maximum``,
    ``minimum``; on a GPU also ``add``, ``sub``, ``mul`` and ``div``, whose kernels take a CPU
    scalar in the tensors' dtype too), the multi-tensor op given that number gives each tensor
    the single-tensor op's bits, in one call instead of one per tensor. Anything else is
    returned as it is, as is ``b`` of another dtype beside a 0-dim tensor (which it would
    promote)."""
    if not (
        isinstance(b, torch.Tensor)
        and b.dim() == 0
        and b.device.type == "cpu"
        and b.is_floating_point()
        and not b.requires_grad
        and not torch._C._functorch.is_functorch_wrapped_tensor(b)
        and a.items
    ):
        return b
    dtype, plain = a.items[0].dtype, a.plain_dtype()
    if dtype not in _CONVERTED_ONCE or plain is None and any(t.dtype is not dtype or t.requires_grad for t in a.items):
        return b
    if b.dtype != dtype and plain is None and any(t.dim() == 0 for t in a.items):  # two 0-dim: b's dtype may win
        return b
    return b.to(dtype).item()


def _binary(foreach: Callable[..., Any], fallback: Callable[..., Any], a: "Leaves", b: Any, **kwargs: Any) -> "Leaves":
    """``foreach(a, b)`` where torch has the multi-tensor form for ``b`` (tensors, a number, or,
    for add/mul/div, a 0-dim tensor on the tensors' device; for maximum, minimum and the clamps,
    a 0-dim CPU tensor read as a number: :func:`_cpu_number`), else ``fallback`` on each pair."""
    if foreach in _READ_AS_NUMBER or foreach in _READ_AS_NUMBER_ON_A_GPU and _on_a_gpu(a):
        b = _read_number(foreach, b, a)
        if isinstance(b, list):  # a division by a CPU factor on a GPU (_DIVIDES)
            return Leaves(foreach(a.items, b, **kwargs), plain=a._known_plain())
    if isinstance(b, Leaves):
        plain = a._known_plain()  # a result of a's dtype only where b's is the same
        return Leaves(
            foreach(a.items, _items(b, len(a.items)), **kwargs), plain=plain if plain is b._known_plain() else None
        )
    if _is_scalar(b) or foreach in _TENSOR_OVERLOAD and _is_shared_scalar(b, a):
        operand = _scalar_operand(foreach, a, b)
        if operand is not None:  # a number, or a 0-dim real tensor autograd does not record: a's dtype
            keeps = not (isinstance(b, torch.Tensor) and b.requires_grad)
            return Leaves(foreach(a.items, operand, **kwargs), plain=a._known_plain() if keeps else None)
    return _map(fallback, (a, b), kwargs)


def _binary_in_place(
    foreach: Optional[Callable[..., Any]], method: str, a: "Leaves", b: Any, **kwargs: Any
) -> "Leaves":
    """``a``'s tensors overwritten with ``a <op> b``: ``foreach`` (torch's in-place multi-tensor
    op) for tensors, a number (on a GPU also a 0-dim CPU tensor read as one: :func:`_cpu_number`)
    or a shared 0-dim tensor, else the tensor method on each pair."""
    if foreach is not None and foreach in _READ_AS_NUMBER_ON_A_GPU and _on_a_gpu(a):
        b = _read_number(foreach, b, a)
        if isinstance(b, list):  # a division by a CPU factor on a GPU (_DIVIDES)
            foreach(a.items, b, **kwargs)
            return a
    operand = (
        _scalar_operand(foreach, a, b) if foreach is not None and (_is_scalar(b) or _is_shared_scalar(b, a)) else None
    )
    if foreach is not None and isinstance(b, Leaves):
        foreach(a.items, _items(b, len(a.items)), **kwargs)
    elif foreach is not None and operand is not None:
        foreach(a.items, operand, **kwargs)
    else:
        for t, x in zip(a.items, _items(_beside(b, a), len(a.items))):
            getattr(t, method)(x, **kwargs)
    return a


def _clamp_in_place(foreach: Callable[..., Any], method: str, a: "Leaves", bound: Any) -> "Leaves":
    """``a``'s tensors clamped in place by ``foreach`` for a number (a 0-dim CPU tensor read as
    one: :func:`_cpu_number`) or tensors, else by the tensor method on each."""
    bound = _cpu_number(bound, a)
    if _is_scalar(bound) or isinstance(bound, Leaves):
        foreach(a.items, bound.items if isinstance(bound, Leaves) else bound)
    else:
        for t, b in zip(a.items, _items(_beside(bound, a), len(a))):
            getattr(t, method)(b)
    return a


def _pointwise_in_place(
    foreach: Callable[..., Any], method: str, a: "Leaves", t1: Any, t2: Any, value: Any
) -> "Leaves":
    """``a += value * (t1 <op> t2)`` in place (``addcmul_``, ``addcdiv_``): ``foreach`` for tensors
    and a number ``value`` (or a 0-dim CPU tensor read as one: :func:`_cpu_number`), else the
    tensor method on each."""
    value = _cpu_number(value, a)
    if isinstance(t1, Leaves) and isinstance(t2, Leaves) and _is_scalar(value):
        foreach(a.items, t1.items, t2.items, value)
    else:
        value = _beside(value, a)
        for t, x, y in zip(a.items, _items(t1, len(a)), _items(t2, len(a))):
            getattr(t, method)(x, y, value=value)
    return a


def _is_shared_scalar(b: Any, a: "Leaves") -> bool:
    """Whether ``b`` is a 0-dim real tensor on the device of ``a``'s tensors (each op then treats
    it as the single-tensor op does: no promotion of ``a``'s dtype by a wider ``b``)."""
    return (
        isinstance(b, torch.Tensor)
        and b.dim() == 0
        and not b.is_complex()
        and len(a.items) > 0
        and b.device == a.items[0].device
    )


LARGE_TENSOR = 1 << 16  # elements: a pass over a tensor this large costs more than a call per tensor


def _large(items: list) -> bool:
    """Whether ``items`` average :data:`LARGE_TENSOR` elements or more: a loop of single-tensor
    ops that fuses two passes into one (``clamp_(min, max)``) then costs less than the second
    multi-tensor op (torch has no multi-tensor clamp with both bounds)."""
    return bool(items) and sum(t.numel() for t in items) >= LARGE_TENSOR * len(items)


def _facts_of(items: list) -> tuple:
    """``(dtype, device, plain dtype)`` of tensors: each ``None`` where they do not share it; the
    plain dtype where they share a floating-point dtype and a device, none is 0-dim and none
    requires grad."""
    if not items:
        return (None, None, None)
    dtype, device = items[0].dtype, items[0].device
    same_dtype = same_device = True
    plain = True
    for t in items:
        if t.dtype is not dtype:
            same_dtype = plain = False
        if t.device != device:
            same_device = False
        if plain and (t.dim() == 0 or t.requires_grad):
            plain = False
    plain = plain and same_device and dtype.is_floating_point  # ops with numbers keep it (an int's would not)
    return (dtype if same_dtype else None, device if same_device else None, dtype if plain else None)


class Tape:
    """The operations a rule ran on :class:`Leaves` (:func:`recorded`), to run them again on other
    tensors of the same kinds (:meth:`run_on`): the rule's own Python (its scalar arithmetic, the
    numbers it reads from step counts) runs once, its operations on each list of tensors.

    Attributes:
        calls: per operation, in order, ``(op, args, kwargs, result)``: the outermost calls of
            ``Leaves`` methods and of torch functions on ``Leaves``.
        values_read: whether the rule read values of its ``Leaves`` into Python (a number it
            then computes with, :func:`values_read`): the operations may then differ between
            lists of tensors, and are not run again.
    """

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.values_read = False
        self._plan: list[tuple] = []  # per call: op, args and kwargs with slots, result slots
        self._slots: dict[int, int] = {}  # per recorded Leaves' id: its place in a run's values
        self._places = 0  # how many places a run's values take

    def runs_on(self, inputs: Sequence["Leaves"]) -> bool:
        """Whether the operations can run again with other ``inputs``: no values read, every
        ``Leaves`` an operation took (as an argument itself, not inside another value) one of
        ``inputs`` or made by an earlier operation, and each result a ``Leaves`` (or a tuple of
        them). Where they can, their plan is made (each ``Leaves`` numbered).

        Args:
            inputs: the ``Leaves`` the rule was given.
        """
        if self.values_read:
            return False
        slots: dict[int, int] = {}
        for k, x in enumerate(inputs):  # an input given twice: its first place
            slots.setdefault(id(x), k)
        made_so_far = len(inputs)  # the places of the operations' results, after the inputs'
        plan = []
        for op, args, kwargs, result in self.calls:
            arg_slots = [_slot_of(a, slots) for a in args]
            kwarg_slots = {k: _slot_of(v, slots) for k, v in kwargs.items()}
            if any(s is None for s in (*arg_slots, *kwarg_slots.values())):
                return False
            made = [result] if isinstance(result, Leaves) else list(result) if isinstance(result, tuple) else []
            if not made or not all(isinstance(r, Leaves) for r in made):
                return False
            made_slots = []
            for r in made:
                if id(r) not in slots:  # else an in-place op's self: the place it has
                    slots[id(r)] = made_so_far
                    made_so_far += 1
                made_slots.append(slots[id(r)])
            plan.append(
                (
                    op,
                    [s.value if isinstance(s, _Constant) else None for s in arg_slots],  # the constants in place
                    [(i, s) for i, s in enumerate(arg_slots) if type(s) is int],  # the Leaves: their slots
                    {k: s.value for k, s in kwarg_slots.items() if isinstance(s, _Constant)},
                    [(k, s) for k, s in kwarg_slots.items() if type(s) is int],
                    isinstance(result, tuple),
                    made_slots,
                )
            )
        self._plan, self._slots, self._places = plan, slots, made_so_far
        return True

    def gives(self, result: Any) -> bool:
        """Whether every ``Leaves`` in ``result`` (the rule's) is an input or an operation's
        result (after :meth:`runs_on`): what :meth:`run_on` can say it became."""
        return all(id(x) in self._slots for x in _leaves_in(result))

    def run_on(self, inputs: Sequence["Leaves"]) -> "_Replayed":
        """The operations again, on ``inputs`` in place of the rule's (in the order given to
        :meth:`runs_on`, which said they may). Returns what each recorded ``Leaves`` became
        (its ``of(value)``: ``value`` with each recorded ``Leaves`` replaced)."""
        values: list[Any] = [None] * self._places
        values[: len(inputs)] = inputs
        for op, constants, leaves_at, kwarg_constants, kwarg_leaves_at, gives_tuple, made_slots in self._plan:
            args = list(constants)
            for i, s in leaves_at:
                args[i] = values[s]
            kwargs = dict(kwarg_constants)
            for k, s in kwarg_leaves_at:
                kwargs[k] = values[s]
            made = op(*args, **kwargs)
            if gives_tuple:
                for s, m in zip(made_slots, made):
                    values[s] = m
            else:
                values[made_slots[0]] = made
        return _Replayed(self._slots, values)


class _Constant:
    """An operand that is not a ``Leaves`` (a number, a 0-dim tensor): the same on every run."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _slot_of(value: Any, slots: dict[int, int]) -> Any:
    """A recorded operand as :meth:`Tape.runs_on` plans it: a ``Leaves`` its slot (``None`` where
    it is unknown), anything else a :class:`_Constant` (``None`` where it holds a ``Leaves``)."""
    if isinstance(value, Leaves):
        return slots.get(id(value))
    if isinstance(value, (tuple, list, dict)) and any(True for _ in _leaves_in(value)):
        return None
    return _Constant(value)


class _Replayed:
    """What each recorded ``Leaves`` became on a run of a :class:`Tape` on other inputs."""

    def __init__(self, slots: dict[int, int], values: list) -> None:
        self.slots, self.values = slots, values

    def of(self, value: Any) -> Any:
        """``value`` (a rule's result: a ``Leaves``, a tuple or NamedTuple of them, anything
        else) with each recorded ``Leaves`` replaced by what it became."""
        if isinstance(value, Leaves):
            return self.values[self.slots[id(value)]]
        if isinstance(value, tuple):
            parts = [self.of(v) for v in value]
            return type(value)(*parts) if hasattr(type(value), "_fields") else tuple(parts)
        if isinstance(value, list):
            return [self.of(v) for v in value]
        if isinstance(value, dict):
            return {k: self.of(v) for k, v in value.items()}
        return value


def _leaves_in(value: Any) -> Iterator["Leaves"]:
    if isinstance(value, Leaves):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves_in(v)


class _Recording(threading.local):
    """This thread's :class:`Tape` being recorded (``None``: none), and how deep inside a
    recorded operation the code runs (an operation's own operations are not recorded)."""

    def __init__(self) -> None:
        self.tape: Optional[Tape] = None
        self.depth = 0


_RECORDING = _Recording()


@contextlib.contextmanager
def recorded() -> Iterator[Tape]:
    """Within the block, in this thread, the operations on :class:`Leaves` are recorded on the
    :class:`Tape` yielded.

    Example::

        g1, g2 = Leaves(gs[:2]), Leaves(gs[2:])
        with foreach.recorded() as tape:
            u1 = rule(g1)
        if tape.runs_on([g1]) and tape.gives(u1):
            u2 = tape.run_on([g2]).of(u1)  # rule(g2)'s operations, the rule's Python not run again
    """
    outer = (_RECORDING.tape, _RECORDING.depth)
    _RECORDING.tape, _RECORDING.depth = Tape(), 0
    try:
        yield _RECORDING.tape
    finally:
        _RECORDING.tape, _RECORDING.depth = outer


def values_read() -> None:
    """Note that the code running now read values of ``Leaves`` into Python (a number, a branch):
    the operations recorded now (:func:`recorded`) may not be run again on other tensors."""
    if _RECORDING.tape is not None:
        _RECORDING.tape.values_read = True


def run_in_chunks(rule: Callable[..., Any], chunk_args: Sequence[Sequence[Any]], results: list) -> list:
    """``rule(*args)`` for each chunk's ``args`` (its ``Leaves``, also inside tuples such as a
    state, and values shared by every chunk: numbers, step counts), one chunk after the other:
    the rule itself on the first, its operations recorded (:func:`recorded`), and where they may
    (:meth:`Tape.runs_on`), those operations again on each next one; else the rule on each, one
    tensor at a time on a chunk where it raises :class:`PerTensorOnly` (before it writes
    anything, as :func:`run_grouped` assumes; on the first chunk it raises, for its caller to
    run the step one tensor at a time). Each result (with the structure of the first's) is
    appended to ``results`` as its chunk is done (what was done where one raises), which is
    returned.

    Args:
        rule: a rule written for single tensors, whose operations depend on its numbers only.
        chunk_args: per chunk, the rule's arguments, the ``Leaves`` in the same places.
        results: the list the results are appended to.
    """
    if len(chunk_args) == 1:  # one chunk: the rule
        results.append(rule(*chunk_args[0]))
        return results
    tape: Optional[Tape] = None
    for k, args in enumerate(chunk_args):
        leaves = list(_leaves_in(args))
        if tape is not None:
            results.append(tape.run_on(leaves).of(results[0]))
            continue
        if k > 0:  # the rule reads its tensors' values: on this chunk, or one tensor at a time where
            try:  # they differ (it raises before it writes anything, as for run_grouped)
                results.append(rule(*args))
            except PerTensorOnly:
                results.append(_each_alone(rule, args, len(leaves[0])))
            continue
        with recorded() as recording:
            results.append(rule(*args))
        if recording.runs_on(leaves) and recording.gives(results[0]):
            tape = recording
        recording.calls.clear()  # the first chunk's temporaries freed: their memory (in the cache) reused
    return results


def _each_alone(rule: Callable[..., Any], args: Sequence[Any], n: int) -> Any:
    """``rule(*args)`` one tensor at a time (each ``Leaves`` of ``args``, of ``n`` tensors, taken
    one tensor at a time), the results joined back into ``Leaves`` of ``n``."""
    return _joined([rule(*_one_of(args, j)) for j in range(n)])


def _one_of(value: Any, j: int) -> Any:
    """``value`` with each ``Leaves`` in it (also inside tuples and lists) its ``j``-th tensor alone."""
    if isinstance(value, Leaves):
        return Leaves([value.items[j]], given=value.given, plain=value._known_plain())
    if isinstance(value, tuple):
        parts = [_one_of(v, j) for v in value]
        return type(value)(*parts) if hasattr(type(value), "_fields") else tuple(parts)
    if isinstance(value, list):
        return [_one_of(v, j) for v in value]
    return value


def _joined(parts: list) -> Any:
    """Results of a rule on one tensor each, as one result: each ``Leaves`` the tensors of all,
    anything else (a value they share: a count computed from the same one) the first's."""
    first = parts[0]
    if isinstance(first, Leaves):
        return Leaves([t for part in parts for t in part.items])
    if isinstance(first, tuple):
        joined = [_joined([part[i] for part in parts]) for i in range(len(first))]
        return type(first)(*joined) if hasattr(type(first), "_fields") else tuple(joined)
    if isinstance(first, list):
        return [_joined([part[i] for part in parts]) for i in range(len(first))]
    return first


def _recorded_op(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` (a ``Leaves`` method, or a function of ``Leaves``) whose outermost calls, while a
    :class:`Tape` is recorded in this thread, are appended to it."""

    @functools.wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
        now = _RECORDING
        if now.tape is None or now.depth:
            return op(*args, **kwargs)
        now.depth += 1
        try:
            result = op(*args, **kwargs)
        finally:
            now.depth -= 1
        now.tape.calls.append((op, args, kwargs, result))
        return result

    return run


class Leaves:
    """Tensors of one device and dtype, operated on together (module docstring).

    Args:
        items: the tensors.
    """

    __slots__ = ("items", "given", "_facts")

    def __init__(
        self, items: Sequence[torch.Tensor], given: Optional[list] = None, plain: Optional[torch.dtype] = None
    ) -> None:
        self.items = list(items)
        self.given = given  # state its caller gave up (:func:`updated`): where its overwrites are noted
        # (dtype, device, plain dtype): what the tensors share, read once (_facts_of); ``plain`` given
        # by an op whose result is known to be plain as its input was
        self._facts: Optional[tuple] = (plain, self.items[0].device, plain) if plain is not None and items else None

    def __len__(self) -> int:
        return len(self.items)

    # ---- what the tensors share ---------------------------------------------------------------

    def _shared(self) -> tuple:
        if self._facts is None:
            self._facts = _facts_of(self.items)
        return self._facts

    def _known_plain(self) -> Optional[torch.dtype]:
        """:meth:`plain_dtype` where it is known already (else ``None``: not worked out here)."""
        return self._facts[2] if self._facts is not None else None

    def plain_dtype(self) -> Optional[torch.dtype]:
        """The tensors' dtype where they share it, none of them is 0-dim and autograd records none
        (the usual group, checked once per ``Leaves``); else ``None``."""
        return self._shared()[2]

    def _common(self, name: str) -> Any:
        shared = {"dtype": 0, "device": 1}.get(name)
        if shared is not None and self._shared()[shared] is not None:
            return self._shared()[shared]
        values = {getattr(t, name) for t in self.items}
        if len(values) != 1:
            raise PerTensorOnly(f"the tensors differ in {name}")
        return values.pop()

    @property
    def dtype(self) -> torch.dtype:
        return self._common("dtype")

    @property
    def device(self) -> torch.device:
        return self._common("device")

    @property
    def requires_grad(self) -> bool:
        """Whether autograd records any of the tensors."""
        return any(t.requires_grad for t in self.items)

    def is_complex(self) -> bool:
        return any(t.is_complex() for t in self.items)

    def is_floating_point(self) -> bool:
        return all(t.is_floating_point() for t in self.items)

    def __getattr__(self, name: str) -> Any:
        """Any other tensor method, on each tensor; attributes (``shape``, ``ndim``) are per tensor."""
        if name.startswith("__"):
            raise AttributeError(name)
        attribute = getattr(torch.Tensor, name, None)
        if not callable(attribute):
            raise PerTensorOnly(f"{name} is a property of each tensor")
        return functools.partial(_method_on_each, attribute, self)

    def __bool__(self) -> bool:
        raise PerTensorOnly("the truth value of several tensors")

    # ---- arithmetic -----------------------------------------------------------------------------

    def add(self, other: Any, alpha: Any = 1) -> "Leaves":
        if _is_scalar(alpha) and alpha == 1:
            return _binary(torch._foreach_add, torch.add, self, other)
        if _is_scalar(alpha) and isinstance(other, Leaves):
            return Leaves(torch._foreach_add(self.items, other.items, alpha=alpha))
        return _map(torch.add, (self, other), {"alpha": alpha})

    def sub(self, other: Any, alpha: Any = 1) -> "Leaves":
        if _is_scalar(alpha) and alpha == 1:
            return _binary(torch._foreach_sub, torch.sub, self, other)
        if _is_scalar(alpha) and isinstance(other, Leaves):
            return Leaves(torch._foreach_sub(self.items, other.items, alpha=alpha))
        return _map(torch.sub, (self, other), {"alpha": alpha})

    def mul(self, other: Any) -> "Leaves":
        return _binary(torch._foreach_mul, torch.mul, self, other)

    def div(self, other: Any) -> "Leaves":
        return _binary(torch._foreach_div, torch.div, self, other)

    def maximum(self, other: Any) -> "Leaves":
        return _binary(torch._foreach_maximum, torch.maximum, self, other)

    def minimum(self, other: Any) -> "Leaves":
        return _binary(torch._foreach_minimum, torch.minimum, self, other)

    def pow(self, exponent: Any) -> "Leaves":
        return _binary(torch._foreach_pow, torch.pow, self, exponent)

    def lerp(self, end: Any, weight: Any) -> "Leaves":
        weight = _cpu_number(weight, self)
        if isinstance(end, Leaves) and (_is_scalar(weight) or isinstance(weight, Leaves)):
            return Leaves(
                torch._foreach_lerp(
                    self.items, end.items, _items(weight, len(self)) if isinstance(weight, Leaves) else weight
                )
            )
        return _map(torch.lerp, (self, end, weight), {})

    def addcmul(self, t1: Any, t2: Any, value: Any = 1) -> "Leaves":
        value = _cpu_number(value, self)
        if isinstance(t1, Leaves) and isinstance(t2, Leaves) and _is_scalar(value):
            return Leaves(torch._foreach_addcmul(self.items, t1.items, t2.items, value))
        return _map(torch.addcmul, (self, t1, t2), {"value": value})

    def addcdiv(self, t1: Any, t2: Any, value: Any = 1) -> "Leaves":
        value = _cpu_number(value, self)
        if isinstance(t1, Leaves) and isinstance(t2, Leaves) and _is_scalar(value):
            return Leaves(torch._foreach_addcdiv(self.items, t1.items, t2.items, value))
        return _map(torch.addcdiv, (self, t1, t2), {"value": value})

    # ---- in place: on a rule's own temporaries (tensors it made and has not returned), and through
    # updated() on the state its caller gave up -----------------------------------------------------

    def add_(self, other: Any, alpha: Any = 1) -> "Leaves":
        if _is_scalar(alpha) and alpha == 1:
            return _binary_in_place(torch._foreach_add_, "add_", self, other)
        if _is_scalar(alpha) and isinstance(other, Leaves):
            torch._foreach_add_(self.items, other.items, alpha=alpha)
            return self
        return _binary_in_place(None, "add_", self, other, alpha=alpha)

    def mul_(self, other: Any) -> "Leaves":
        if _is_scalar(other) and self.dtype in _HALF_TYPES:  # torch's _foreach_mul_ rounds these unlike
            for t in self.items:  # mul_, mul and _foreach_mul (CPU, torch 2.13), which agree
                t.mul_(other)
            return self
        return _binary_in_place(torch._foreach_mul_, "mul_", self, other)

    def div_(self, other: Any) -> "Leaves":
        return _binary_in_place(torch._foreach_div_, "div_", self, other)

    def addcmul_(self, t1: Any, t2: Any, value: Any = 1) -> "Leaves":
        return _pointwise_in_place(torch._foreach_addcmul_, "addcmul_", self, t1, t2, value)

    def addcdiv_(self, t1: Any, t2: Any, value: Any = 1) -> "Leaves":
        return _pointwise_in_place(torch._foreach_addcdiv_, "addcdiv_", self, t1, t2, value)

    def sqrt_(self) -> "Leaves":
        torch._foreach_sqrt_(self.items)
        return self

    def neg_(self) -> "Leaves":
        torch._foreach_neg_(self.items)
        return self

    def clamp_min_(self, minimum: Any) -> "Leaves":
        return _clamp_in_place(torch._foreach_clamp_min_, "clamp_min_", self, minimum)

    def clamp_max_(self, maximum: Any) -> "Leaves":
        return _clamp_in_place(torch._foreach_clamp_max_, "clamp_max_", self, maximum)

    def clamp_(self, min: Any = None, max: Any = None) -> "Leaves":  # noqa: A002  (torch's names)
        """``clamp`` in place: the two multi-tensor clamps for numbers (and 0-dim CPU tensors)."""
        min, max = _cpu_number(min, self), _cpu_number(max, self)  # noqa: A001
        if min is None and max is None or not all(v is None or _is_scalar(v) for v in (min, max)):
            min, max = _beside(min, self), _beside(max, self)  # noqa: A001
            for t, low, high in zip(self.items, _items(min, len(self)), _items(max, len(self))):
                t.clamp_(low, high)
            return self
        if min is not None and max is not None and _large(self.items):  # one pass each: the calls cost less
            for t in self.items:
                t.clamp_(min, max)
            return self
        if min is not None:
            torch._foreach_clamp_min_(self.items, min)
        if max is not None:
            torch._foreach_clamp_max_(self.items, max)
        return self

    def lerp_(self, end: Any, weight: Any) -> "Leaves":
        weight = _cpu_number(weight, self)
        if isinstance(end, Leaves) and _is_scalar(weight):
            torch._foreach_lerp_(self.items, end.items, weight)
        elif isinstance(end, Leaves) and isinstance(weight, Leaves):
            torch._foreach_lerp_(self.items, end.items, weight.items)
        else:
            for t, e, w in zip(self.items, _items(end, len(self)), _items(_beside(weight, self), len(self))):
                t.lerp_(e, w)
        return self

    def clamp_min(self, minimum: Any) -> "Leaves":
        return _binary(torch._foreach_clamp_min, torch.clamp_min, self, minimum)

    def clamp_max(self, maximum: Any) -> "Leaves":
        return _binary(torch._foreach_clamp_max, torch.clamp_max, self, maximum)

    def clamp(self, min: Any = None, max: Any = None) -> "Leaves":  # noqa: A002  (torch's names)
        """``min(max(t, min), max)``, as ``torch.clamp``: the two multi-tensor clamps for numbers
        (and 0-dim CPU tensors read as numbers: ``_cpu_number``)."""
        min, max = _cpu_number(min, self), _cpu_number(max, self)  # noqa: A001
        if min is None and max is None or not all(v is None or _is_scalar(v) for v in (min, max)):
            return _map(torch.clamp, (self,), {"min": min, "max": max})
        low = self if min is None else self.clamp_min(min)
        return low if max is None else low.clamp_max(max)

    def sqrt(self) -> "Leaves":
        return Leaves(torch._foreach_sqrt(self.items), plain=self._known_plain())

    def abs(self) -> "Leaves":
        return Leaves(torch._foreach_abs(self.items))

    def neg(self) -> "Leaves":
        return Leaves(torch._foreach_neg(self.items), plain=self._known_plain())

    def sign(self) -> "Leaves":
        return Leaves(torch._foreach_sign(self.items))

    def exp(self) -> "Leaves":
        return Leaves(torch._foreach_exp(self.items), plain=self._known_plain())

    def reciprocal(self) -> "Leaves":
        return Leaves(torch._foreach_reciprocal(self.items), plain=self._known_plain())

    def to(self, *args: Any, **kwargs: Any) -> "Leaves":
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype):  # a cast: as Tensor.to,
            if all(t.dtype == args[0] for t in self.items):  # itself if there
                return self
        return _map(torch.Tensor.to, (self, *args), kwargs)

    __add__ = add
    __sub__ = sub
    __mul__ = mul
    __truediv__ = div
    __pow__ = pow
    __neg__ = neg
    __abs__ = abs

    def __radd__(self, other: Any) -> "Leaves":
        return self.add(other)

    def __rmul__(self, other: Any) -> "Leaves":
        return self.mul(other)

    # reflected operators run as torch.Tensor's own (``2 / t`` is ``t.reciprocal() * 2`` there)
    def __rsub__(self, other: Any) -> "Leaves":
        if _on_a_gpu(self):
            other = _cpu_number(other, self)
        if _is_scalar(other):  # -t + other: the same rounding as other - t
            return Leaves(torch._foreach_add(torch._foreach_neg(self.items), other))
        return _map(torch.Tensor.__rsub__, (self, other), {})

    def __rtruediv__(self, other: Any) -> "Leaves":
        return _map(torch.Tensor.__rtruediv__, (self, other), {})

    def __rpow__(self, other: Any) -> "Leaves":
        if _is_scalar(other):
            return Leaves(torch._foreach_pow(other, self.items))
        return _map(torch.Tensor.__rpow__, (self, other), {})

    def __gt__(self, other: Any) -> "Leaves":
        return _map(torch.gt, (self, other), {})

    def __lt__(self, other: Any) -> "Leaves":
        return _map(torch.lt, (self, other), {})

    def __ge__(self, other: Any) -> "Leaves":
        return _map(torch.ge, (self, other), {})

    def __le__(self, other: Any) -> "Leaves":
        return _map(torch.le, (self, other), {})

    def __eq__(self, other: Any) -> "Leaves":  # type: ignore[override]
        return _map(torch.eq, (self, other), {})

    def __ne__(self, other: Any) -> "Leaves":  # type: ignore[override]
        return _map(torch.ne, (self, other), {})

    __hash__ = None  # type: ignore[assignment]

    # ---- torch functions called with Leaves ------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> Any:
        return _torch_function_on_leaves(func, *args, **(kwargs or {}))


@_recorded_op
def _method_on_each(method: Any, leaves: Leaves, *args: Any, **kwargs: Any) -> Any:
    """The tensor method ``method`` on each tensor of ``leaves`` (``Leaves.__getattr__``)."""
    return _map(method, (leaves, *args), kwargs)


@_recorded_op
def _torch_function_on_leaves(func: Any, *args: Any, **kwargs: Any) -> Any:
    """The torch function ``func`` called with ``Leaves`` (``Leaves.__torch_function__``)."""
    fast = _FAST.get(func)
    if fast is not None and isinstance(args[0], Leaves):
        return fast(*args, **kwargs)
    reflected = _REFLECTED.get(func)
    if reflected is not None and len(args) == 2 and not kwargs and isinstance(args[1], Leaves) and _on_a_gpu(args[1]):
        number = _cpu_number(args[0], args[1])  # a 0-dim CPU tensor first (``b * leaves``): a number
        if _is_scalar(number):
            return getattr(args[1], reflected)(number)
    return _map(func, args, kwargs)


# a tensor's operator with Leaves second: the Leaves method that computes it with a number first
# (add and mul commute)
_REFLECTED = {torch.Tensor.add: "add", torch.Tensor.mul: "mul", torch.Tensor.sub: "__rsub__"}


_OPERATIONS = (  # the Leaves methods that compute (recorded: _recorded_op)
    *("add", "sub", "mul", "div", "maximum", "minimum", "pow", "lerp", "addcmul", "addcdiv", "add_", "mul_"),
    *("div_", "addcmul_", "addcdiv_", "sqrt_", "neg_", "clamp_min_", "clamp_max_", "clamp_", "lerp_", "clamp_min"),
    *("clamp_max", "clamp", "sqrt", "abs", "neg", "sign", "exp", "reciprocal", "to", "__radd__", "__rmul__"),
    *("__rsub__", "__rtruediv__", "__rpow__", "__gt__", "__lt__", "__ge__", "__le__", "__eq__", "__ne__"),
)
for _name in _OPERATIONS:
    setattr(Leaves, _name, _recorded_op(getattr(Leaves, _name)))
for _alias, _name in (("__add__", "add"), ("__sub__", "sub"), ("__mul__", "mul"), ("__truediv__", "div")):
    setattr(Leaves, _alias, getattr(Leaves, _name))
for _alias, _name in (("__pow__", "pow"), ("__neg__", "neg"), ("__abs__", "abs")):
    setattr(Leaves, _alias, getattr(Leaves, _name))


_FAST: dict = {
    torch.maximum: Leaves.maximum,
    torch.minimum: Leaves.minimum,
    torch.sqrt: Leaves.sqrt,
    torch.abs: Leaves.abs,
    torch.sign: Leaves.sign,
    torch.lerp: Leaves.lerp,
    torch.addcmul: Leaves.addcmul,
    torch.addcdiv: Leaves.addcdiv,
    torch.add: Leaves.add,
    torch.mul: Leaves.mul,
    torch.div: Leaves.div,
}


def updated(old: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``getattr(old, method)(*args, **kwargs)`` as the new value of the state tensor ``old``:
    computed in ``old``'s own memory (its in-place form, ``method + "_"``: ``mu.lerp_(g, w)``)
    where ``old`` holds state its caller gave up (``functional_bagua.ownership``; the grouped
    path marks such state) and none of its tensors is 0-dim (an op on a 0-dim tensor and a 0-dim
    float64 factor computes in float64 out of place, in the tensor's dtype in place), else as a
    new tensor: the same numbers either way. The rule must not read ``old`` after this line (a
    test per rule runs both ways and compares the bits). The overwrite is noted before it is made:
    a method that raised part-way must not run again on what it left.

    Args:
        old: a state tensor (or :class:`Leaves` of them) the rule replaces with the result.
        method: the tensor method that computes the new value (one with an in-place form).
        *args: its arguments.
        **kwargs: its keyword arguments.

    Example::

        mu = foreach.updated(s.mu, "lerp", g, 1 - b1)      # the new first moment
    """
    if (
        isinstance(old, Leaves)
        and old.given is not None
        and (old.plain_dtype() is not None or all(t.dim() for t in old.items))
    ):
        old.given.append(method)
        getattr(old, method + "_")(*args, **kwargs)
        return old
    return getattr(old, method)(*args, **kwargs)


def groups(
    tensors: Sequence[Any], indices: Iterable[int], key: Callable[[int], Any] = lambda i: None
) -> list[list[int]]:
    """The ``indices`` of ``tensors`` grouped by device, dtype and ``key(index)``, in order; complex
    tensors are left out (their rules run on real views, one tensor at a time).

    Args:
        tensors: tensors (or ``None``) by index; only those at ``indices`` are looked at.
        indices: which tensors to group.
        key: anything else that must be equal within a group (say, whether a parameter is given).
    """
    indices = list(indices)
    picked = [tensors[i] for i in indices]
    keyed = list(zip(read_each("device", picked), read_each("dtype", picked), map(key, indices)))
    if keyed and keyed.count(keyed[0]) == len(keyed):  # one group, the usual case
        return [] if keyed[0][1].is_complex else [indices]
    found: dict[tuple, list[int]] = {}
    for i, k in zip(indices, keyed):
        if not k[1].is_complex:
            found.setdefault(k, []).append(i)
    return list(found.values())


def run_groups(
    rule: Callable[..., Any],
    columns: Sequence[Sequence[Any]],
    indices: Sequence[int],
    key: Callable[[int], Any] = lambda i: None,
    given: Sequence[int] = (),
) -> tuple[list[tuple[list[int], Any]], list[int]]:
    """``rule`` once per group of the tensors at ``indices`` of the first column (:func:`groups`),
    with :func:`run_grouped`: the ``(members, result)`` of each group that ran, and the indices
    left to run one tensor at a time (complex tensors, groups whose rule needs single tensors).

    Args:
        rule: a rule written for single tensors (its arguments: one per column).
        columns: per argument of the rule, one value per tensor; the first column is grouped.
        indices: which tensors to run.
        key: as for :func:`groups`.
        given: as for :func:`run_grouped`.
    """
    ran, done = [], set()
    for members in groups(columns[0], indices, key):
        result = run_grouped(rule, columns, members, given)
        if result is not None:
            ran.append((members, result))
            done.update(members)
    return ran, [i for i in indices if i not in done]


def writable_in_place(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are dense float32 or float64 tensors of one dtype and device, none
    0-dim nor recorded by autograd (:meth:`Leaves.plain_dtype`), none starting where another
    does: what a step written into parameters and state in place (a link's ``apply_in_place``,
    which ``fb.Optimizer`` calls) may write.

    Args:
        tensors: every tensor the step reads or writes.
    """
    return (
        len(tensors) > 0
        and Leaves(tensors).plain_dtype() in (torch.float32, torch.float64)
        and all(t.layout is torch.strided for t in tensors)
        and len({t.data_ptr() for t in tensors}) == len(tensors)
    )


def writable_part(
    indices: list[int], tensors_of: Callable[[list[int]], list[torch.Tensor]], numbers_now: bool = False
) -> list[int]:
    """The ``indices`` whose tensors (``tensors_of(indices)``: every tensor the step of those
    indices reads or writes) a step may write into in place, on the CPU (and on any device where
    ``numbers_now``): all of them where they may be together (:func:`writable_in_place`, the
    usual case: one dtype); else those whose own tensors each may be (float32 or float64, not
    0-dim, dense, not recorded by autograd), of either dtype, where none of them starts where
    another does (else ``[]``). The others then take another path (a pure update, added).

    Args:
        indices: the tensors' indices, in order.
        tensors_of: the tensors of some of the indices.
        numbers_now: the step's factors are Python numbers whatever the tensors' device (its
            scalars held on the CPU, as ``fb.Optimizer`` holds them beside a GPU's tensors).
    """
    if not indices:
        return []
    tensors = tensors_of(indices)
    if writable_in_place(tensors) and (numbers_now or tensors[0].device.type == "cpu"):
        return list(indices)
    alone = [i for i in indices if all(_writable_alone(t, numbers_now) for t in tensors_of([i]))]
    chosen = tensors_of(alone) if alone else []
    return alone if len({t.data_ptr() for t in chosen}) == len(chosen) else []


def _writable_alone(t: Any, numbers_now: bool) -> bool:
    """Whether ``t`` alone may be written in place (:func:`writable_in_place` of one tensor, on
    the CPU unless ``numbers_now``), checked directly."""
    return (
        isinstance(t, torch.Tensor)
        and t.dtype in (torch.float32, torch.float64)
        and t.dim() > 0
        and t.layout is torch.strided
        and not t.requires_grad
        and (numbers_now or t.device.type == "cpu")
    )


def run_each(
    rule: Callable[..., Any], columns: Sequence[Sequence[Any]], indices: Sequence[int], given: Sequence[int] = ()
) -> dict[int, Any]:
    """``rule`` on the tensors at ``indices`` of each column: grouped (:func:`run_groups`) where
    grouping is on and the rule runs so, else one tensor at a time, with the same bits either
    way; ``{index: the rule's result for that tensor}`` (a tuple where the rule returns one).

    Args:
        rule: a rule written for single tensors (its arguments: one per column).
        columns: per argument of the rule, one value per tensor.
        indices: which tensors to run.
        given: as for :func:`run_grouped`.

    Example::

        norms = foreach.run_each(lambda g: g.abs().sum(), [grads], range(len(grads)))
    """
    ran, singles = run_groups(rule, columns, indices, given=given) if grouped_enabled() else ([], list(indices))
    out: dict[int, Any] = {}
    for members, result in ran:
        for k, i in enumerate(members):
            out[i] = tuple(part[k] for part in result) if isinstance(result, tuple) else result[k]
    for i in singles:
        out[i] = rule(*(column[i] for column in columns))
    return out


def run_grouped(
    rule: Callable[..., Any],
    columns: Sequence[Sequence[Any]],
    indices: Sequence[int],
    given: Sequence[int] = (),
    one_values: bool = False,
) -> Optional[Any]:
    """``rule`` once over the tensors at ``indices`` of each column, as :class:`Leaves`: its result
    with each ``Leaves`` replaced by its list of tensors (one per index; a value the rule shares
    between the tensors, such as ``None``, repeated), or ``None`` when the rule needs one tensor at
    a time (:class:`PerTensorOnly`, or any error, which the per-tensor path then raises again).

    Args:
        rule: a rule written for single tensors (its arguments: one per column).
        columns: per argument of the rule, a sequence with one value per tensor; a column of
            ``None`` s is passed as ``None``, one with some ``None`` s makes the group run per tensor.
        indices: which tensors form the group.
        given: the columns of state its caller gave up (:func:`updated` may overwrite them), as
            far as each holds tensors that no other column of the group shares.
        one_values: a tensor the rule shares between the tensors (a step count computed once
            for the group) as :class:`OneValue` (its caller places the copies) instead of a
            list of copies; the result is then ``(result, writable)``, ``writable`` the
            ``given`` columns whose equal scalars the rule got as one (a step count per tensor)
            and that no other tensor of the group shares: their tensors may take the copies.
    """
    args: list[Any] = []
    scalars: dict[int, list] = {}  # given columns passed as their one shared scalar: their tensors
    for c, column in enumerate(columns):
        picked = [column[i] for i in indices]
        if picked[0] is None and all(v is None for v in picked):
            args.append(None)
        elif any(v is None for v in picked):  # some tensors without: one at a time
            return None
        else:
            args.append(_shared_or_leaves(picked, beside=[columns[0][i] for i in indices] if c else None))
            if c in given and not isinstance(args[-1], Leaves):
                scalars[c] = picked
    overwrites: list = []  # what updated() overwrote: then no falling back to one tensor at a time
    writable = _unshared(args, given, scalars)
    for c in writable:
        if c not in scalars:
            args[c] = Leaves(args[c].items, given=overwrites)
    try:
        result = rule(*args)
    except Exception as error:  # anything a rule cannot do grouped (PerTensorOnly, ...): it runs per
        if _SWITCH.strict:  # tensor, where a genuine error raises again
            raise
        if overwrites:
            raise RuntimeError(
                f"a rule raised {type(error).__name__} after overwriting the state it was given ({overwrites}); "
                "it cannot run again one tensor at a time: the state given up is part-stepped"
            ) from error
        return None
    lists = _as_lists(result, len(indices), one_values)
    return (lists, frozenset(c for c in writable if c in scalars)) if one_values else lists


def _unshared(args: list, given: Sequence[int], scalars: Optional[dict] = None) -> list[int]:
    """The ``given`` columns among ``args`` that are :class:`Leaves` (or, in ``scalars``, one
    shared scalar standing for the tensors listed there) of tensors whose memory no other tensor
    in ``args`` starts at (a state tensor that is a parameter, or shares one tensor with another
    field or tensor, is computed as new tensors, not overwritten)."""
    scalars = scalars or {}
    tensors_of = {c: args[c].items for c in given if isinstance(args[c], Leaves)}
    tensors_of.update(scalars)
    if not tensors_of:
        return []
    others: set = set()
    for c, a in enumerate(args):
        if c not in tensors_of:
            tensors = a.items if isinstance(a, Leaves) else [a] if isinstance(a, torch.Tensor) else []
            others.update(t.data_ptr() for t in tensors)
    addresses = {c: [t.data_ptr() for t in column] for c, column in tensors_of.items()}  # empty ones: 0, shared
    counts = collections.Counter(address for column in addresses.values() for address in column)
    return [c for c in tensors_of if not any(counts[a] > 1 or a in others for a in addresses[c])]


def _shared_or_leaves(picked: list, beside: Optional[list] = None) -> Any:
    """The column's one value when it holds equal 0-dim CPU tensors of an integer dtype (step
    counts) or float64 (the float64 scalars some rules keep beside their tensors, where every
    tensor of the group stepped as often) beside the tensors ``beside`` (the group's first
    column: float64 only where none of them is 0-dim, else a 0-dim float64 moment of a 0-dim
    parameter would be taken for one): the rule's scalar arithmetic on it then runs once for the
    group, with the values (so the bits) each tensor would have; else ``Leaves``."""
    first = picked[0]
    uniform = (
        isinstance(first, torch.Tensor)
        and first.dim() == 0
        and first.device.type == "cpu"
        and (first.dtype == torch.float64 or not (first.is_floating_point() or first.is_complex()))
        and all(isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == first.dtype and t.is_cpu for t in picked)
    )
    if uniform and first.dtype == torch.float64:
        uniform = beside is not None and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in beside)
    if uniform and (len(picked) == 1 or same_bits(picked)):
        return first
    return Leaves(picked)


def same_bits(scalars: Sequence[torch.Tensor]) -> bool:
    """Whether 0-dim tensors of one dtype and device all hold the same bits (0.0 and -0.0 compare
    equal, but are not the same), in one comparison of them stacked."""
    stacked = torch.stack(list(scalars))
    if stacked.is_floating_point():
        stacked = stacked.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[stacked.element_size()])
    return bool((stacked == stacked[0]).all())


class OneValue:
    """A tensor a grouped rule computed once for the ``n`` tensors of its group (a step count
    from their shared count): each tensor's value is a copy of it (:func:`run_grouped`).

    Args:
        value: the tensor.
        n: the number of tensors in the group.
    """

    __slots__ = ("value", "n")

    def __init__(self, value: torch.Tensor, n: int) -> None:
        self.value, self.n = value, n

    def copies(self) -> list:
        """``n`` new tensors holding the value: none aliases another's (in-place kernels step
        counts one by one)."""
        return [self.value.clone() for _ in range(self.n)]

    def copied_into(self, olds: list) -> list:
        """The value copied into ``olds``, state tensors their caller gave up and no other
        tensor shares (``writable`` of :func:`run_grouped`): one multi-tensor copy instead of
        ``n`` new tensors, where each is a tensor of the value's shape, dtype and device that
        autograd does not record; else :meth:`copies`."""
        value = self.value
        fits = len(olds) == self.n and all(
            isinstance(o, torch.Tensor)
            and o.shape == value.shape
            and o.dtype == value.dtype
            and o.device == value.device
            and not o.requires_grad
            for o in olds
        )
        if not fits:
            return self.copies()
        torch._foreach_copy_(olds, [value] * self.n)
        return list(olds)


def _as_lists(result: Any, n: int, one_values: bool = False) -> Any:
    if isinstance(result, Leaves):
        return result.items
    if isinstance(result, tuple):
        parts = [_as_lists(r, n, one_values) for r in result]
        return type(result)(*parts) if hasattr(type(result), "_fields") else tuple(parts)
    if isinstance(result, torch.Tensor):
        one = OneValue(result, n)
        return one if one_values else one.copies()
    return [result] * n  # a value the rule shares between the tensors (a None, a constant)
