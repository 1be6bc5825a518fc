"""Sphinx configuration: the API reference from the docstrings (autodoc, Google-style ``Args:``
through napoleon), the guides in Markdown (MyST), the furo theme. Built in strict mode by
``sphinx-build -W -n -b html docs docs/_build/html``: a warning, a broken cross-reference
among them, fails the build."""

from __future__ import annotations

project = "functional-bagua"
author = "the functional-bagua authors"
copyright = "2026, the functional-bagua authors"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "functional-bagua"

autodoc_default_options: dict = {}  # each directive names its options (api_pages.py)
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Cross-references to names outside this package: no inventories are fetched (the build runs
# offline), so they are left as text rather than reported broken.
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|optree|typing|collections|numpy|lightning|transformers|enum|abc)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Optional|Sequence|Iterable|Iterator|Mapping|NamedTuple|Union|Tensor|PyTree)"),
    # torch's names as the annotations spell them (``import torch.distributed as dist``) and as the
    # docstrings that torch.nn.Module's methods pass on to subclasses write them
    (r"py:class", r"dist\..*"),
    (r"py:class", r"(Module|Dataset|Dropout|BatchNorm)"),
    # internal type aliases and private classes that annotations name (not part of the documented API)
    (r"py:class", r"(Factory|Group|functional_bagua\.distributed\.process_group\.Group)"),
    (r"py:class", r"functional_bagua\.(.*\.)?_\w+"),
]


def _write_generated_pages(app) -> None:  # the API reference and the benchmark pages (with figures)
    import pathlib
    import sys

    here = pathlib.Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import api_pages
    import benchmark_pages

    api_pages.write(here / "api")
    benchmark_pages.write(here)


def _skip_tuple_fields(app, what, name, obj, skip, options):  # a NamedTuple's "Alias for field number 0"
    doc = getattr(obj, "__doc__", None) or ""
    return True if doc.startswith("Alias for field number") else None


def setup(app) -> None:
    app.connect("autodoc-skip-member", _skip_tuple_fields)
    app.connect("builder-inited", _write_generated_pages)
