"""The numbers a transform was built with, and the same transform built with others.

An alias called with numbers (``fb.adamw(1e-3)``) records how it was made: the alias and its
arguments (``tx.update.built_from``). A transform made of such aliases, chained
(:func:`~functional_bagua.chain`) or given to one as its inner transform
(``fb.lookahead(fb.adamw(1e-3))``), can then be made again with other values for those numbers::

    found = Adjustable.of(fb.chain(fb.clip_by_global_norm(1.0), fb.adamw(1e-3)))
    found.numbers["lr"]                        # 0.001
    tx = found.with_numbers({"lr": lr_tensor})  # the chain, with fb.adamw(lr_tensor)

The adjustable numbers are the aliases' float hyperparameters (those whose default is a float,
or a tuple of them: ``lr``, ``betas``, ``weight_decay``; and :func:`~functional_bagua.scale_by_learning_rate`'s
``learning_rate``, as ``lr``), each under its own name where exactly one alias of the transform takes it (a chain of two aliases with an ``lr`` each has no
adjustable ``lr``). :class:`~functional_bagua.Optimizer` shows them in its param groups, so
that torch's lr schedulers drive a transform built with numbers as they drive torch.optim's
groups. Built again with 0-dim tensors, a transform reads the tensors' values at every update,
so a compiled step that reads them is never compiled again for a new value.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch

from functional_bagua.base import GradientTransformation, chain

Path = tuple[Union[int, str], ...]  # chain positions (int) and inner-transform arguments (str)


@dataclasses.dataclass(frozen=True)
class _Alias:
    """One alias inside a transform: where it sits, and how it was built."""

    path: Path
    factory: Callable[..., GradientTransformation]
    arguments: dict[str, Any]

    def float_hyperparameters(self) -> dict[str, tuple[str, Any]]:
        """``{shown name: (argument, value)}``: its arguments (given, or defaults) whose default is
        a float or a tuple of floats, or that the factory names in its ``shown_as`` (with the name
        to show: ``scale_by_learning_rate``'s ``learning_rate`` is an ``"lr"``), where their value
        is a number, a one-element tensor, or a tuple of those."""
        shown_as = getattr(self.factory, "shown_as", {})
        found = {}
        for name, p in inspect.signature(self.factory).parameters.items():
            if _is_float_default(p.default) or name in shown_as:
                value = self.arguments.get(name, p.default)
                if _is_numeric(value):
                    found[shown_as.get(name, name)] = (name, value)
        return found


@dataclasses.dataclass(frozen=True)
class Adjustable:
    """A transform's adjustable numbers (module docstring).

    Attributes:
        tx: the transform as built.
        numbers: ``{name: value}``, the value each adjustable number was built with.
    """

    tx: GradientTransformation
    numbers: dict[str, Any]
    _owner: dict[str, tuple[Path, str]]  # the alias that takes each name, and its argument

    @classmethod
    def of(cls, tx: GradientTransformation) -> Optional[Adjustable]:
        """``tx``'s adjustable numbers; ``None`` where it has none (a transform made of building
        blocks, an injected one, or one whose aliases all share their names)."""
        takers: dict[str, list[tuple[_Alias, str, Any]]] = {}
        for alias in _aliases(tx, ()):
            for name, (argument, value) in alias.float_hyperparameters().items():
                takers.setdefault(name, []).append((alias, argument, value))
        unique = {name: found[0] for name, found in takers.items() if len(found) == 1}
        if not unique:
            return None
        numbers = {name: value for name, (_, _, value) in unique.items()}
        return cls(tx, numbers, {name: (alias.path, argument) for name, (alias, argument, _) in unique.items()})

    def with_numbers(self, values: dict[str, Any]) -> GradientTransformation:
        """The transform built again with ``values`` (``{name: value}``, adjustable names only:
        a KeyError names another) in place of the numbers it was built with; the others as built.

        Args:
            values: the new values: numbers, 0-dim tensors, tuples of them (``betas``).
        """
        by_alias: dict[Path, dict[str, Any]] = {}
        for name, value in values.items():
            if name not in self._owner:
                raise KeyError(f"{name!r} is not an adjustable number of this transform ({sorted(self._owner)})")
            path, argument = self._owner[name]
            by_alias.setdefault(path, {})[argument] = value
        return _rebuilt(self.tx, (), by_alias)


def _aliases(tx: GradientTransformation, path: Path) -> Iterator[_Alias]:
    """The aliases built with numbers inside ``tx``: itself, its chain's links, the inner
    transforms it was given, recursively."""
    built = getattr(tx.update, "built_from", None)
    if built is not None:
        factory, arguments = built
        yield _Alias(path, factory, arguments)
        for name, value in arguments.items():
            if isinstance(value, GradientTransformation):
                yield from _aliases(value, (*path, name))
        return
    for i, link in enumerate(getattr(tx.update, "transforms", ())):
        yield from _aliases(link, (*path, i))


def _rebuilt(tx: GradientTransformation, path: Path, by_alias: dict[Path, dict[str, Any]]) -> GradientTransformation:
    """``tx`` built again where ``by_alias`` gives an alias inside it new values; ``tx`` itself
    where nothing inside it changes."""
    built = getattr(tx.update, "built_from", None)
    if built is not None:
        factory, arguments = built
        new = dict(arguments)
        for name, value in arguments.items():
            if isinstance(value, GradientTransformation):
                new[name] = _rebuilt(value, (*path, name), by_alias)
        new.update(by_alias.get(path, {}))
        changed = any(new[k] is not arguments.get(k) for k in new)
        return factory(**new) if changed else tx
    links = getattr(tx.update, "transforms", None)
    if links is None:
        return tx
    new_links = [_rebuilt(link, (*path, i), by_alias) for i, link in enumerate(links)]
    return chain(*new_links) if any(a is not b for a, b in zip(new_links, links)) else tx


def _is_float_default(default: Any) -> bool:
    if isinstance(default, tuple):
        return bool(default) and any(isinstance(d, float) for d in default)
    return isinstance(default, float)


def _is_numeric(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(v is None or _is_numeric(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)
