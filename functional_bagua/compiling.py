"""``torch.compile`` for functions the library builds, one compilation per built function.

Dynamo keeps its compiled graphs, and counts recompilations against ``recompile_limit`` (8), per
code object. Every closure made by one ``def`` shares that code object: eight train steps built
in one process would use up the limit, and the ninth (a hyperparameter sweep, a second model, a
test suite) fails with ``FailOnRecompileLimitHit``. :func:`compile_own` compiles a copy of the
function with a code object of its own, so each built function has its own cache and its own
limit, as a function written by hand would. Its calls also raise the library's own errors
raised while tracing (:func:`raised_while_tracing`), not dynamo's wrapper of them.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import types
from typing import Any, Callable, Optional

import torch

_serial = itertools.count()


def own_code(fn: Callable) -> Callable:
    """A copy of ``fn`` (same globals, closure, defaults and attributes) with a code object of its
    own, named ``<name>_<n>`` (which is how it shows in dynamo's logs).

    Args:
        fn: a Python function (not a builtin, not a bound method).

    While traced (a transform built inside a compiled update, by ``inject_hyperparams``), ``fn``
    itself: the graph inlines it, no code object is compiled for it.
    """
    if torch.compiler.is_compiling():
        return fn
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_serial)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    copy.__dict__.update(fn.__dict__)
    copy.__wrapped__ = fn  # type: ignore[attr-defined]  # what it copies (ownership.granted_to)
    return copy


def compile_own(fn: Callable, **compile_kwargs: Any) -> Callable:
    """``torch.compile(own_code(fn), **compile_kwargs)`` (module docstring), whose calls raise
    the TypeError or ValueError that the traced code raised (dynamo reports it as
    ``Unsupported: Observed exception``, the message buried in its context): a schedule that
    reads the step count as a Python number, say, fails with the library's message.

    Example::

        step = compile_own(pure_step, fullgraph=True)
    """
    compiled = torch.compile(own_code(fn), **compile_kwargs)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as e:
            raised = raised_while_tracing(e)
            if raised is None:
                raise
            raise raised from e

    return call


_OBSERVED = re.compile(r"raised exception (TypeError|ValueError)\((.*)\)", re.DOTALL)
# torch 2.11-2.12 put it in the debug context of the whole message, as a ConstantVariable's repr
_PYTHON_STRING = r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"
_OBSERVED_IN_CONTEXT = re.compile(
    rf"raised exception (TypeError|ValueError)\(\[ConstantVariable\(str: ({_PYTHON_STRING})\)\]\)"
)


def raised_while_tracing(error: BaseException) -> Optional[Exception]:
    """The TypeError or ValueError that the code dynamo traced raised, rebuilt from the
    exceptions chained to ``error`` (dynamo names it ``raised exception TypeError('...')``), or
    ``None`` when there is none."""
    seen: set = set()
    cause: Optional[BaseException] = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        found = _OBSERVED.fullmatch(str(cause).strip()) or _OBSERVED_IN_CONTEXT.search(str(cause))
        if found is not None:
            try:
                message = ast.literal_eval(found.group(2))
            except (ValueError, SyntaxError):
                return None
            return (TypeError if found.group(1) == "TypeError" else ValueError)(message)
        cause = cause.__cause__ or cause.__context__
    return None
