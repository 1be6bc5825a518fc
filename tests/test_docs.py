"""The public API documents its arguments: ``help(fb.adamw)`` shows what each one means."""

from __future__ import annotations

import enum
import inspect

import pytest

import functional_bagua as fb
import functional_bagua.compat as compat
import functional_bagua.distributed as fbd
from functional_bagua import schedules

pytestmark = pytest.mark.cpu_only("checks the documentation's text, not tensors")


def public_callables():
    modules = [
        (fb, fb.__all__),
        (fbd, fbd.__all__),
        (compat, compat.__all__),
        (
            schedules,
            [
                n
                for n, v in vars(schedules).items()
                if inspect.isfunction(v) and v.__module__ == schedules.__name__ and not n.startswith("_")
            ],
        ),
    ]
    for module, names in modules:
        for name in names:
            value = getattr(module, name)
            # NamedTuple states document their fields; enums their members
            is_state = inspect.isclass(value) and issubclass(value, (tuple, enum.Enum))
            if (inspect.isfunction(value) or inspect.isclass(value)) and not is_state:
                yield pytest.param(value, id=f"{module.__name__}.{name}")


@pytest.mark.parametrize("obj", list(public_callables()))
def test_every_public_function_documents_its_arguments(obj):
    parameters = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
    doc = inspect.getdoc(obj) or ""
    if parameters:
        assert "Args:" in doc, f"{obj.__qualname__}: no Args section"
        args = doc[doc.index("Args:") :]
        missing = [p for p in parameters if p not in args]
        assert not missing, f"{obj.__qualname__}: Args does not name {missing}"
