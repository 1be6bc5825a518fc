"""``bagua`` and ``bagua.torch_api.*`` as names of this compat layer, for unmodified Bagua scripts.

:func:`install` registers, in ``sys.modules``, ``bagua.torch_api`` as
:mod:`functional_bagua.compat` and every ``bagua.torch_api.<path>`` as
``functional_bagua.compat.<path>`` (``algorithms.gradient_allreduce``, ``contrib``,
``data_parallel``, ``communication``...), and ``bagua`` as a package holding ``torch_api``. A
script's ``import bagua.torch_api as bagua`` or ``from bagua.torch_api.algorithms import
decentralized`` then gets this layer's modules, and a Bagua module this layer does not have
raises ImportError as it would anywhere. A real ``bagua`` already imported in the process is left
alone (a RuntimeError) unless ``replace=True``; once installed, the aliases take precedence over
an installed Bagua.

    python -m functional_bagua.compat.bagua_alias script.py [args]    # install, then run the script

:mod:`functional_bagua.compat.launch` starts every rank this way.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import runpy
import sys
import types

import functional_bagua.compat as compat

PREFIX = "bagua.torch_api"


def install(replace: bool = False) -> list[str]:
    """Register the aliases (module docstring); returns the ``bagua.*`` names registered.

    Args:
        replace: also when a ``bagua`` module is already imported (a real Bagua); otherwise
            that case raises a RuntimeError, so that two Baguas never mix in one process.
    """
    present = sys.modules.get("bagua")
    if present is not None and getattr(present, "__functional_bagua_alias__", False) is False and not replace:
        raise RuntimeError(
            "a module 'bagua' is imported already (the real Bagua?); pass replace=True to use "
            "functional_bagua.compat under its names instead"
        )
    top = types.ModuleType("bagua", "Bagua's names, served by functional_bagua.compat")
    top.__path__ = []  # a package: its submodules come from sys.modules
    top.__functional_bagua_alias__ = True  # type: ignore[attr-defined]
    top.torch_api = compat  # type: ignore[attr-defined]
    sys.modules["bagua"] = top
    names = ["bagua", PREFIX]
    sys.modules[PREFIX] = compat
    for info in pkgutil.walk_packages(compat.__path__, prefix=compat.__name__ + "."):
        if info.name.rsplit(".", 1)[-1].startswith("_") or info.name.endswith((".launch", ".bagua_alias")):
            continue
        module = importlib.import_module(info.name)
        alias = PREFIX + info.name[len(compat.__name__) :]
        sys.modules[alias] = module
        names.append(alias)
    return names


def main(argv: list[str]) -> None:
    """Install the aliases and run the script ``argv[0]`` with the arguments ``argv[1:]`` as
    ``__main__`` (as ``python script.py args`` would)."""
    if not argv:
        raise SystemExit("usage: python -m functional_bagua.compat.bagua_alias script.py [args]")
    install()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as python script.py puts it first
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
