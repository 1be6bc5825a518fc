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
import contextlib
import functools
import itertools
import re
import types
import warnings
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


_KERNELS: dict[tuple, Callable] = {}
_KERNEL_FAILURES: dict[str, str] = {}  # per device type where inductor could not compile: why
COMPILED_DEVICE_TYPES = ("cpu", "cuda")  # kernels compiled for these; elsewhere (meta, ...) fn itself
# on CUDA, the kernels give eager's numbers: exact division (Triton's x / y is approximate,
# torch's is rounded), no flushing of subnormals to zero, and no contraction of a product and a
# sum into one fused multiply-add (which Triton does unless precision casts are emulated; that
# also keeps each rounding to a narrower dtype, as eager's ops round)
_EXACT = {
    "eager_numerics.division_rounding": True,
    "eager_numerics.disable_ftz": True,
    "emulate_precision_casts": True,
}


def run_compiled(fn: Callable, *tensors: torch.Tensor, static: tuple = (), fixed_shapes: int = 0) -> Any:
    """``fn(*tensors, *static)`` computed by a ``torch.compile``'d copy of ``fn``: for an
    elementwise computation run eagerly that would otherwise take an op, and a pass over memory,
    per line (one kernel instead).

    One compiled copy per ``fn``, ``static`` (hashable Python constants, baked into the graph)
    and device, each with its own code object (:func:`own_code`). The tensors' sizes are
    symbolic (but for the last ``fixed_shapes`` tensors, a table say): one compile serves every
    size, again only where ``fn`` branches on a size. While traced (inside a compiled step),
    ``fn`` itself, which the step's graph fuses; on devices other than the CPU and CUDA (meta
    tensors, say) ``fn`` itself too. Where inductor cannot compile (``BackendCompilerFailed``: no
    C++ compiler, say), a warning, once per device type, and ``fn`` eagerly there from then on
    (the same numbers, op by op). On CUDA the kernels divide exactly and keep subnormals, as
    eager torch does. A caller's ``set_stance("fail_on_recompile")`` does not make a kernel of
    the library's raise: one that would compile again computes ``fn`` eagerly.

    The kernel runs without autograd (``torch.no_grad``): for values that need no gradient,
    such as an optimizer's state.

    Args:
        fn: a function of tensors (and ``static``) that dynamo traces in one graph.
        *tensors: its tensor arguments, on one device.
        static: its other arguments.
        fixed_shapes: how many of the last tensors keep their shapes constant.

    Example::

        wide = run_compiled(bfloat16_uncorrected, value, correction)
    """
    device = tensors[0].device
    if torch.compiler.is_compiling() or device.type not in COMPILED_DEVICE_TYPES or device.type in _KERNEL_FAILURES:
        return fn(*tensors, *static)
    key = (fn, static, str(device), fixed_shapes)
    kernel = _KERNELS.get(key)
    if kernel is None:
        options = _EXACT if device.type == "cuda" else None
        kernel = _KERNELS[key] = compile_own(
            _with_constants(fn, static), dynamic=False, fullgraph=True, options=options
        )
    # sizes symbolic and the constants constant (under dynamic=True an int is symbolic too),
    # marked on new tensor objects (detach: the same memory, no view of a base to guard on), so
    # that the caller's own tensors keep their own compiling
    inputs = [t.detach() for t in tensors]
    for t in inputs[: len(inputs) - fixed_shapes]:
        for dim in range(t.dim()):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    try:
        with torch.no_grad(), _own_stance():  # one graph whatever the caller's grad mode
            return kernel(*inputs)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        cause = getattr(failed, "inner_exception", failed)
        _KERNEL_FAILURES[device.type] = f"{type(cause).__name__}: {cause}".strip().splitlines()[0]
        warnings.warn(
            f"functional_bagua: torch.compile could not compile {fn.__name__} on {device.type} here "
            f"({_KERNEL_FAILURES[device.type]}); computing it eagerly, op by op, from now on (the same numbers, "
            "slower)",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(*tensors, *static)


def _own_stance() -> contextlib.AbstractContextManager:
    """Where the caller forbids recompiling (``torch.compiler.set_stance("fail_on_recompile")``,
    for its own compiled step), the library's kernels run with ``"eager_on_recompile"``: a
    kernel compiled for these tensors' shape class runs, another computes ``fn`` eagerly (the
    same numbers) instead of raising in the caller's optimizer step. Else the caller's stance."""
    stance = getattr(
        getattr(torch._dynamo.eval_frame, "_stance", None), "stance", "default"
    )  # torch keeps it privately
    if stance == "fail_on_recompile":
        return torch.compiler.set_stance("eager_on_recompile")
    return contextlib.nullcontext()


def _with_constants(fn: Callable, static: tuple) -> Callable:
    """``fn`` with ``static`` as its last arguments, held in a closure: constants of the graph
    (a block size that is symbolic keeps inductor from vectorizing the division of an index by
    it). Named after ``fn`` (in dynamo's logs)."""

    def kernel(*tensors: torch.Tensor) -> Any:
        return fn(*tensors, *static)

    kernel.__code__ = kernel.__code__.replace(co_name=fn.__name__)
    kernel.__name__ = kernel.__qualname__ = fn.__name__
    return kernel
