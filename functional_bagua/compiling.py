"""``torch.compile`` for functions the library builds, one compilation per built function.

Dynamo keeps its compiled graphs, and counts recompilations against ``recompile_limit`` (8), per
code object. Every closure made by one ``def`` shares that code object: eight train steps built
in one process would use up the limit, and the ninth (a hyperparameter sweep, a second model, a
test suite) fails with ``FailOnRecompileLimitHit``. :func:`compile_own` compiles a copy of the
function with a code object of its own, so each built function has its own cache and its own
limit, as a function written by hand would.
"""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable

import torch

_serial = itertools.count()


def own_code(fn: Callable) -> Callable:
    """A copy of ``fn`` (same globals, closure and defaults) with a code object of its own, named
    ``<name>_<n>`` (which is how it shows in dynamo's logs).

    Args:
        fn: a Python function (not a builtin, not a bound method).
    """
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_serial)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    return copy


def compile_own(fn: Callable, **compile_kwargs: Any) -> Callable:
    """``torch.compile(own_code(fn), **compile_kwargs)`` (module docstring).

    Example::

        step = compile_own(pure_step, fullgraph=True)
    """
    return torch.compile(own_code(fn), **compile_kwargs)
