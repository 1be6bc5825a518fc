"""Hyperparameters as data: tensors in the optimizer state, or schedules of the step count.

``inject_hyperparams(factory)(**hyperparams)`` builds ``factory(**hyperparams)`` anew at every
update with each numeric hyperparameter as a 0-dim float64 tensor held in the state::

    tx = fb.inject_hyperparams(fb.adamw)(lr=fb.schedules.warmup_cosine_decay(0, 1e-3, 100, 1000),
                                         weight_decay=0.01)
    state = tx.init(params)
    state.hyperparams["weight_decay"].fill_(0.05)      # takes effect at the next update
    state.hyperparams["lr"]                            # the lr of the last update (from the schedule)

Because the values are tensors, a compiled step neither bakes them in nor recompiles when they
change. A schedule is evaluated from the wrapper's count (the number of updates done: 0, 1, ...,
the step of torch's LR schedulers), and its value is written into ``state.hyperparams``.

Eagerly, where the values are held on the host, each update builds the factory with them read as
Python numbers: the transform the alias built with those numbers is, its steps the same bits
(fused factors, no term for a weight decay of 0). The transform so built is kept while the
values stay the same. Where the factory builds a state of another structure for the numbers (a
momentum of 0 keeps no buffer), the values stay tensors; this is checked once per set of values
read and of their kinds (0, the sign, infinite, 1 or more), on meta tensors. Under
torch.compile, for values held on a device (reading one would wait for it) and for values
differentiated through (autograd, ``torch.func``), the factory gets the tensors.

Change a value in place, ``state.hyperparams["lr"].fill_(1e-4)``. A scheduled hyperparameter
set so by hand takes effect too, and holds that value while the schedule's values differ from it:
an update tells a hand-set value by comparing the held one with what the schedule gave the last
update, ``where(held == schedule(count - 1), schedule(count), held)`` (branch-free, so also inside a
compiled step). So a value the schedule itself passes through hands control back to the
schedule there, and setting the value the schedule gave last changes nothing. Assigning a Python number
(``state.hyperparams["lr"] = 1e-4``, the optax habit) works eagerly; under torch.compile it
raises a TypeError, since every new number would compile the step again. A schedule receives the
count as a 0-dim float64 tensor: one that uses it as a Python number (``if t < 3``,
``math.cos(t)``, as written for torch's ``LambdaLR``) works eagerly and raises a TypeError naming
it under torch.compile (write it with ``torch.where``, ``torch.cos``, ...).

Which arguments become tensors: floats, tensors and schedules (callables), also inside tuples
(``betas=(0.9, 0.999)``). Ints, bools, strings and ``None`` stay static (``ns_steps``,
``amsgrad``...), as does every name in ``static_args``.

An alias given a tensor hyperparameter (``fb.adamw(lr=torch.tensor(1e-3))``) reads it at every
update, as torch.optim reads a tensor ``lr``: :func:`accepts_schedules` builds it through
:func:`reading_tensors`, so ``lr.fill_(1e-4)`` takes effect at the next update.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union, overload

import torch

from functional_bagua import ownership, tree
from functional_bagua.base import GradientTransformation
from functional_bagua.numerics import SCALAR_DTYPE, holds_tensor, is_real_number, readable_now, takes_cpu_scalars
from functional_bagua.schedules import (
    describe,
    reads_count_as_number,
    refuse_untraceable,
    step_count,
)
from functional_bagua.tree import PyTree

# True while inject_hyperparams rebuilds its factory with the tensors it holds (see
# hyperparams_are_checked). A context variable, not a module global: each thread and task has its own.
_REBUILDING = contextvars.ContextVar("functional_bagua_rebuilding_with_checked_hyperparams", default=False)


def checkable(value: object) -> Optional[float]:
    """The number to validate hyperparameter ``value`` against now: a Python number as it is, a
    one-element tensor's value (a hyperparameter given as a tensor is checked as torch checks
    it), and ``None`` for a schedule and for the tensors that were validated already
    (:func:`hyperparams_are_checked`).

    Args:
        value: a hyperparameter as a factory receives it: a number, a tensor or a schedule. A bool,
            a tensor of more than one element and any other value also give ``None``.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not hyperparams_are_checked():
        return value.item()
    return None


def check_hyperparameter(value: object, ok: Callable[[float], bool], message: str) -> None:
    """Raise ``ValueError(message.format(value))`` unless ``ok`` holds for ``value``, where it can
    be checked now (:func:`checkable`: a number, or a one-element tensor not validated yet; a
    tensor validated already is not read, so a factory rebuilt inside a traced step does not
    break its graph). The message is formatted only on failure: inside a traced step a value may
    be symbolic, and formatting it would break the trace.

    Args:
        value: a hyperparameter as a factory receives it.
        ok: whether a number is allowed.
        message: the error's text, with ``{}`` where the value goes.
    """
    number = checkable(value)
    if number is not None and not ok(number):
        raise ValueError(message.format(value))


def hyperparams_are_checked() -> bool:
    """Whether the tensor hyperparameters a factory receives now were validated already: inside
    a traced step (where they cannot be read), and while :func:`inject_hyperparams` rebuilds its
    factory on an update (it validated their initial values when it was built). Factories read
    tensor hyperparameters only when this is False."""
    return torch.compiler.is_compiling() or _REBUILDING.get()


def built_with_checked_values(
    factory: Callable[..., GradientTransformation], *args: Any, **kwargs: Any
) -> GradientTransformation:
    """``factory(*args, **kwargs)`` with its tensor hyperparameters taken as validated already
    (:func:`hyperparams_are_checked`): a transform that builds its factory anew at every update
    from tensors it validated once, without reading them (a device sync each) every time."""
    if torch.compiler.is_compiling():
        return factory(*args, **kwargs)
    token = _REBUILDING.set(True)
    try:
        return factory(*args, **kwargs)
    finally:
        _REBUILDING.reset(token)


def reading_tensors(
    factory: Callable[..., GradientTransformation], *args: Any, **kwargs: Any
) -> GradientTransformation:
    """``factory`` built anew from its arguments at every ``init`` and ``update``, where some are
    tensors: a value written into one in place (a scheduler's ``fill_``, a hand-set
    ``lr.fill_(1e-4)``) is read by the next update, as torch.optim reads a tensor ``lr``. Built
    once, a factory would keep what it computed from the tensors then (``-lr``, ``1 - beta``).
    The values are validated once, here.

    Args:
        factory: the alias.
        *args: its arguments, some tensors.
        **kwargs: its keyword arguments.
    """
    factory(*args, **kwargs)  # raises now for invalid values, as the factory does
    keeps_structure: dict[tuple, bool] = {}  # per kind of values read as numbers (_numbers_now)

    def built_now(like: Optional[PyTree] = None) -> GradientTransformation:
        """The transform an update runs now: the factory built from the tensors as they hold
        now. A caller may run it itself (``fb.Optimizer`` writes its chain's last link into
        the parameters). Given the tensors the state is for (``like``), eagerly, the values
        held on the host are given to the factory as Python numbers, as the alias built with
        them gets them (its rules then take their numbers' paths: fused factors, a step
        written into the parameters, the alias's bits), where the transform so built makes a
        state of the structure the tensors' one does (checked once per kind of values, as
        :func:`inject_hyperparams` checks it)."""
        if like is None or torch.compiler.is_compiling():
            return built_with_checked_values(factory, *args, **kwargs)
        numbers, read = _numbers_now({**dict(enumerate(args)), **kwargs})
        if not read or keeps_structure.get(read) is False:  # no value read, or a kind known to differ
            return built_with_checked_values(factory, *args, **kwargs)
        with_numbers = factory(*(numbers[i] for i in range(len(args))), **{k: numbers[k] for k in kwargs})
        if read not in keeps_structure:
            with_tensors = built_with_checked_values(factory, *args, **kwargs)
            keeps_structure[read] = same_state_structure(with_numbers, with_tensors, like)
            if not keeps_structure[read]:
                return with_tensors
        return with_numbers

    def init(params: PyTree) -> Any:
        return built_now().init(params)

    def update(updates: PyTree, state: Any, params: Optional[PyTree] = None) -> tuple[PyTree, Any]:
        return built_now().update(updates, state, params)

    update.built_now = built_now  # type: ignore[attr-defined]
    return GradientTransformation(init, update)


@takes_cpu_scalars  # held on the CPU, its numbers are read as Python numbers: the transform built with them
class InjectHyperparamsState(NamedTuple):
    """``count``: updates done; ``hyperparams``: name -> 0-dim tensor (or tuple of them);
    ``inner_state``: the state of the transform the factory builds."""

    count: torch.Tensor  # type: ignore[assignment]  # a field named like tuple.count, as in optax
    hyperparams: dict
    inner_state: Any


def _is_dynamic_leaf(x: object) -> bool:
    return (isinstance(x, float) or isinstance(x, torch.Tensor) or callable(x)) and not isinstance(x, bool)


def _is_dynamic(value: object) -> bool:
    if isinstance(value, tuple):
        return any(_is_dynamic_leaf(v) for v in value)
    return _is_dynamic_leaf(value)


def _leaves(value: object) -> tuple:
    """A hyperparameter's values: itself, or the elements of a tuple (``betas``)."""
    return value if isinstance(value, tuple) else (value,)


def _map_dynamic(fn: Callable[[Any], Any], value: Any) -> Any:
    """Apply ``fn`` to the dynamic leaves of a hyperparameter (itself, or each tuple element)."""
    if isinstance(value, tuple):
        return tuple(fn(v) if _is_dynamic_leaf(v) else v for v in value)
    return fn(value)


def _value_at(hyperparameter: Any, count: Union[int, torch.Tensor]) -> Any:
    """A schedule's value at ``count``; any other value as it is."""
    return _map_dynamic(lambda v: v(count) if callable(v) else v, hyperparameter)


def _as_tensor(value: Any, device: Optional[torch.device]) -> torch.Tensor:
    return torch.as_tensor(value, dtype=SCALAR_DTYPE, device=device)


def _as_number(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) else value


def inject_hyperparams(
    factory: Callable[..., GradientTransformation], static_args: Sequence[str] = ()
) -> Callable[..., GradientTransformation]:
    """Wrap ``factory`` so that its numeric hyperparameters live in the state (module docstring).

    The values are validated once, when the wrapper is called, by building ``factory`` with them
    as Python numbers (schedules at step 0): invalid ones raise the factory's ValueError then.

    Args:
        factory: a function that builds a :class:`~functional_bagua.GradientTransformation` from
            hyperparameters, such as :func:`~functional_bagua.adamw`.
        static_args: names of arguments passed to ``factory`` as they are given, never held as
            tensors nor called as schedules (say, an inner transform); those an alias declares
            with :func:`accepts_schedules` (ADOPT's ``clip_lambda``, a function) are added.

    Returns:
        A function with ``factory``'s signature that builds the wrapped transform, whose state is an
        :class:`InjectHyperparamsState`.

    Example::

        tx = fb.inject_hyperparams(fb.sgd)(lr=0.1, momentum=0.9)
        state = tx.init(params)
        state.hyperparams["lr"].fill_(0.01)           # the next update uses lr=0.01
    """
    signature = inspect.signature(factory)
    static_args = (*_names(static_args), *getattr(factory, "static_args", ()))

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        arguments = signature.bind(*args, **kwargs).arguments
        dynamic = {k: v for k, v in arguments.items() if k not in static_args and _is_dynamic(v)}
        static = {k: v for k, v in arguments.items() if k not in dynamic}
        factory(**static, **{k: _map_dynamic(_as_number, _value_at(v, 0)) for k, v in dynamic.items()})
        eager_only = {  # id -> name of each schedule that torch.compile cannot trace
            id(v): describe(v)
            for value in dynamic.values()
            for v in _leaves(value)
            if callable(v) and reads_count_as_number(v)
        }

        def tensors_at(count: torch.Tensor, current: dict) -> dict:
            """Each dynamic hyperparameter as a tensor: a schedule's value at ``count``, else the
            value held in ``current`` (which the user may have overwritten)."""

            def now(name: str, given: Any, held: Any) -> torch.Tensor:
                if callable(given):
                    if id(given) in eager_only and torch.compiler.is_compiling():
                        refuse_untraceable(eager_only[id(given)], f"the hyperparameter {name!r}")
                    scheduled = _as_tensor(given(step_count(count)), count.device)
                    if not isinstance(held, torch.Tensor):  # init
                        return scheduled
                    # the value the last update used (init's: the schedule at 0); held differs from it
                    # only if set by hand, and then it stays (module docstring)
                    last = _as_tensor(given(step_count(torch.clamp(count - 1, min=0))), count.device)
                    return torch.where(held == last, scheduled, held.to(scheduled.dtype))
                if torch.compiler.is_compiling() and not isinstance(held, torch.Tensor):
                    raise TypeError(
                        f"state.hyperparams[{name!r}] holds a {type(held).__name__}: under torch.compile every new "
                        "value would compile the step again. Change it in place, "
                        f"state.hyperparams[{name!r}].fill_(value), as optimizer steps compiled once expect"
                    )
                return _as_tensor(held, count.device)

            out: dict[str, Any] = {}
            for name, given in dynamic.items():
                held = current[name]
                if isinstance(given, tuple):
                    out[name] = tuple(now(name, g, h) if _is_dynamic_leaf(g) else g for g, h in zip(given, held))
                else:
                    out[name] = now(name, given, held)
            return out

        def rebuilt(hyperparams: dict) -> GradientTransformation:
            return built_with_checked_values(factory, **static, **hyperparams)

        def init(params: PyTree) -> InjectHyperparamsState:
            count = torch.zeros((), dtype=torch.int64, device=tree.device_of(params))
            hyperparams = tensors_at(count, {k: _value_at(v, 0) for k, v in dynamic.items()})
            inner_state = rebuilt(hyperparams).init(params)
            return InjectHyperparamsState(count, hyperparams, inner_state)

        def update(
            updates: PyTree, state: InjectHyperparamsState, params: Optional[PyTree] = None
        ) -> tuple[PyTree, InjectHyperparamsState]:
            inner, wrapped = step_parts(state, updates if params is None else params)
            with ownership.giving_state(inner.update if ownership.state_given_to(update) else None):
                updates, inner_state = inner.update(updates, state.inner_state, params)
            return updates, wrapped(inner_state)

        keeps_structure: dict[tuple, bool] = {}  # per set of values read as numbers (_numbers_now)
        last_built: Optional[tuple] = None  # the last numbers built with, and the transform

        def built_with_numbers(numbers: dict) -> GradientTransformation:
            """The factory built with ``numbers``: the transform built last when they are the
            same (hyperparameters no scheduler changed), else anew."""
            nonlocal last_built
            if any(holds_tensor(v) for v in numbers.values()):  # it reads tensors when built: anew
                return rebuilt(numbers)
            key = tuple((k, _exactly(v)) for k, v in numbers.items())
            if last_built is None or last_built[0] != key:
                last_built = (key, rebuilt(numbers))
            return last_built[1]

        def step_parts(
            state: InjectHyperparamsState, like: PyTree
        ) -> tuple[GradientTransformation, Callable[[Any], InjectHyperparamsState]]:
            """What ``update`` runs: the transform built with this step's hyperparameters (to
            update ``state.inner_state``, made for the tensors of ``like``, the parameters or the
            updates), and the function that makes its new state this transform's. A caller may
            run the transform itself (``fb.Optimizer`` writes its chain's last link into the
            parameters).

            Eagerly, the values held on the host are given to the factory as Python numbers
            (:func:`_numbers_now`), as the alias built with them gets them: its rules then take
            their numbers' paths (fused factors, no terms at 0), to the alias's bits; where the
            transform so built makes a state of another structure than the one built with
            tensors (a factory may build none for the number 0, say no momentum buffer), the
            tensors. That is checked once per set of values read and of their kinds (0, the
            sign, infinite, 1 or more: :func:`number_kind`), on meta tensors: a factory whose
            state's structure depends on a value otherwise is assumed not to exist."""
            hyperparams = tensors_at(state.count, state.hyperparams)
            numbers, read = _numbers_now(hyperparams)
            if read and keeps_structure.get(read):
                inner = built_with_numbers(numbers)
            else:
                inner = rebuilt(hyperparams)
                if read and read not in keeps_structure:
                    with_numbers = built_with_numbers(numbers)
                    keeps_structure[read] = same_state_structure(with_numbers, inner, like)
                    inner = with_numbers if keeps_structure[read] else inner
            return inner, lambda inner_state: InjectHyperparamsState(state.count + 1, hyperparams, inner_state)

        # the hyperparameters whose value the state holds and no schedule drives (fb.Optimizer
        # shows them in its param groups, for torch's schedulers to write)
        update.adjustable = {k: v for k, v in dynamic.items() if not _holds_schedule(v)}  # type: ignore[attr-defined]
        update.step_parts = step_parts  # type: ignore[attr-defined]
        return GradientTransformation(init, update)

    build.static_args = static_args  # type: ignore[attr-defined]  # for a factory wrapped again
    return build


def _numbers_now(hyperparams: dict) -> tuple[dict, tuple]:
    """``hyperparams`` with each value held in a 0-dim float tensor that can be read now
    (:func:`~functional_bagua.numerics.readable_now`: on the CPU, eagerly, not differentiated
    through) as a Python number; and, for each value so read, its name, position and
    :func:`number_kind` (what a factory may build another structure for)."""
    if torch.compiler.is_compiling():
        return hyperparams, ()
    read: list = []

    def now(name: str, position: int, value: Any) -> Any:
        if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
            return value
        if not readable_now(value):
            return value
        number = value.item()
        read.append((name, position, number_kind(number)))
        return number

    out = {
        name: tuple(now(name, i, v) for i, v in enumerate(value)) if isinstance(value, tuple) else now(name, -1, value)
        for name, value in hyperparams.items()
    }
    return out, tuple(read)


def number_kind(number: float) -> tuple:
    """What a factory may build another state structure for: a value of 0, its sign, an
    infinite one, one of 1 or more (the structure check holds for every value of one kind)."""
    return (number == 0, number > 0, math.isinf(number), abs(number) >= 1)


def _exactly(value: Any) -> Any:
    """``value`` compared by its bits: a float as its hex (``-0.0`` is not ``0.0``, a NaN is
    itself), inside tuples too."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple):
        return tuple(_exactly(v) for v in value)
    return value


def same_state_structure(a: GradientTransformation, b: GradientTransformation, like: PyTree) -> bool:
    """Whether ``a`` and ``b`` make states of one structure, leaf shapes and dtypes for tensors
    like ``like``'s (made on the meta device: no memory); ``False`` where either cannot."""

    def meta(x: Any) -> Any:
        return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

    def described(state: Any) -> tuple:
        leaves, spec = tree.flatten(state)
        kinds = [(leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return spec, kinds

    try:
        on_meta = tree.tree_map(meta, like)
        return described(a.init(on_meta)) == described(b.init(on_meta))
    except Exception:  # an init that reads values: keep the tensors
        return False


def _names(static_args: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """``static_args`` as a tuple of names (one name given as a string is one name)."""
    return (static_args,) if isinstance(static_args, str) else tuple(static_args)


def _holds_schedule(value: object) -> bool:
    if isinstance(value, tuple):
        return any(callable(e) for e in value)
    return callable(value)


_Factory = Callable[..., GradientTransformation]


@overload
def accepts_schedules(alias: _Factory, *, static_args: Sequence[str] = ()) -> _Factory: ...


@overload
def accepts_schedules(alias: None = None, *, static_args: Sequence[str] = ()) -> Callable[[_Factory], _Factory]: ...


def accepts_schedules(
    alias: Optional[_Factory] = None, *, static_args: Sequence[str] = ()
) -> Union[_Factory, Callable[[_Factory], _Factory]]:
    """Let every float hyperparameter of ``alias`` be a schedule: when any argument is callable,
    the alias is built through :func:`inject_hyperparams` (its state is then an
    :class:`InjectHyperparamsState`); otherwise it is built directly. Arguments named in
    ``static_args`` (say, an inner transform) are never taken for schedules::

        @accepts_schedules(static_args=("inner",))
        def lookahead(inner, sync_period=5, alpha=0.5): ...

    Args:
        alias: the factory to wrap; ``None`` when used as ``@accepts_schedules(static_args=...)``,
            which returns the decorator.
        static_args: names of arguments never taken for schedules, nor made tensors by
            :func:`inject_hyperparams`.

    Returns:
        The wrapped factory (with ``alias``'s name and docstring), or, without ``alias``, a decorator
        that makes one.
    """
    if alias is None:
        return functools.partial(accepts_schedules, static_args=static_args)
    static_args = (*_names(static_args), *getattr(alias, "static_args", ()))
    parameters = inspect.signature(alias).parameters
    names = list(parameters)  # no Signature.bind per call: it may run inside a trace
    defaults = {k: p.default for k, p in parameters.items() if k not in static_args}

    def build(args: tuple, kwargs: dict) -> GradientTransformation:
        arguments = [*zip(names, args), *kwargs.items()]
        if any(_holds_schedule(v) for k, v in arguments if k not in static_args):
            return inject_hyperparams(alias, static_args)(*args, **kwargs)
        if not hyperparams_are_checked() and any(holds_tensor(v) for k, v in arguments if k not in static_args):
            return reading_tensors(alias, *args, **kwargs)
        return alias(*args, **kwargs)

    @functools.wraps(alias)
    def wrapper(*args: Any, **kwargs: Any) -> GradientTransformation:
        if torch.compiler.is_compiling():  # fb.Optimizer rebuilding it inside a traced step
            return build(args, kwargs)
        who = alias.__name__
        args = tuple(checked_argument(who, k, defaults.get(k), v) for k, v in zip(names, args))
        kwargs = {k: checked_argument(who, k, defaults.get(k), v) for k, v in kwargs.items()}
        tx = build(args, kwargs)
        if not isinstance(tx.update, functools.partial) and not hasattr(tx.update, "adjustable"):
            # built with numbers: how (a chain compares them across ranks, base.hyperparameters_of)
            tx.update.built_from = (wrapper, {**dict(zip(names, args)), **kwargs})  # type: ignore[attr-defined]
        return tx

    wrapper.static_args = tuple(static_args)  # type: ignore[attr-defined]  # for inject_hyperparams(wrapper)
    return wrapper


def checked_argument(who: str, name: str, default: object, value: Any) -> Any:
    """``value`` as the alias ``who`` takes it for the argument ``name`` whose default is
    ``default``: a numeric hyperparameter (number default) must be a number, a schedule, or a
    tensor of one element (of any shape, as torch.optim accepts it: given back as a 0-dim view,
    so in-place changes still reach it); one with a tuple default (``betas``) a tuple or list of
    as many such values. Anything else raises a TypeError or ValueError naming the argument, so
    ``lr="1e-3"`` or ``betas=(0.9,)`` fail when the alias is built, not inside an update. Other
    arguments (flags, names, inner transforms) pass unchanged.

    Args:
        who: the alias's name, for the message.
        name: the argument's name.
        default: its default in the alias's signature.
        value: what was given.
    """
    if is_real_number(default):
        return _checked_scalar(who, name, value)
    if isinstance(default, tuple) and any(is_real_number(d) for d in default):
        sized = hasattr(value, "__len__") and not isinstance(value, (str, bytes, torch.Tensor))
        if not sized or len(value) != len(default):
            raise ValueError(f"{who}: {name} takes {len(default)} values, as its default {default}; got {value!r}")
        checked = [
            v if d is None and v is None else _checked_scalar(who, f"{name}[{i}]", v)
            for i, (d, v) in enumerate(zip(default, value))
        ]
        return type(value)(checked) if isinstance(value, (tuple, list)) else tuple(checked)  # numpy arrays too
    return value


def _checked_scalar(who: str, name: str, value: Any) -> Any:
    if is_real_number(value) or callable(value):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{who}: {name} must be one number; got a tensor of shape {tuple(value.shape)} ({value.numel()} elements)"
            )
        return value.reshape(()) if value.dim() else value
    hint = ""
    if isinstance(value, str):
        try:
            hint = f"; pass {name.split('[')[0]}={float(value)!r}" if "[" not in name else f"; pass {float(value)!r}"
        except ValueError:
            pass
    raise TypeError(
        f"{who}: {name} must be a number, a one-element tensor or a schedule (a function of the step count); "
        f"got {type(value).__name__} {value!r}{hint}"
    )
