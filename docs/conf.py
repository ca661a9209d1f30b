"""Sphinx configuration of the iofence documentation site.

Build it with ``scripts/test-docs`` (warnings are errors), or by hand::

    python -m sphinx -E -W --keep-going -b html docs build/docs/html

The pages in this folder are Markdown (read by MyST), so they stay readable as plain files
and ``tests/test_docs.py`` keeps running their Python blocks. The API reference
(``docs/api/``) is generated from the docstrings by autodoc, which reads their Google-style
``Args:`` / ``Raises:`` sections through napoleon.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from typing import Any

from sphinx.application import Sphinx
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

project = "iofence"
author = "iofence developers"
copyright = "iofence developers, MIT License"
release = importlib.import_module("fence").__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"iofence {release}"

# MyST: GitHub-style anchors, so that links such as ``orm.md#unit-of-work`` resolve as they
# do on a repository page.
myst_heading_anchors = 4

# autodoc and napoleon: Google-style docstrings, signatures as written in the code.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# ``Attributes:`` become fields of their class, not entries of their own: a dataclass field
# or a property of the same name is documented by autodoc already.
napoleon_use_ivar = True
napoleon_attr_annotations = True

#: Every public module and the names it exports must appear in the API reference.
PUBLIC_MODULES = [
    "fence",
    "fence.abc",
    "fence.testing",
    "fence.prometheus",
    "fence.otel",
    "fence.cli",
    "fence.adapters.redis",
    "fence.adapters.etcd",
    "fence.adapters.zookeeper",
    "fence.adapters.sql",
    "fence.adapters.psycopg",
    "fence.adapters.orm",
    "fence.adapters.celery",
    "fence.adapters.django",
    "fence.adapters.django.operations",
    "fence.adapters.django.locks",
]

_log = logging.getLogger("iofence.docs")


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return list(names)


def _check_reference(app: Sphinx, exception: Exception | None) -> None:
    """Warn (an error under ``-W``) about a public name the API reference leaves out."""
    if exception is not None:
        return
    documented = set(app.env.domains["py"].objects)
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        if module_name not in documented:
            _log.warning("API reference: module %s is not documented", module_name)
        for name in _public_names(module):
            if inspect.ismodule(getattr(module, name)):
                continue
            if f"{module_name}.{name}" not in documented:
                _log.warning("API reference: %s.%s is not documented", module_name, name)


def _defining_docs() -> dict[tuple[str, int], list[str]]:
    """The ``#:`` comments of the package's module-level constants, by name and value.

    A public module re-exports constants defined in a private one (``fence.MAX_TOKEN`` is
    ``fence._core.MAX_TOKEN``); autodoc reads ``#:`` comments only in the module it
    documents, so the API pages name such constants with ``autodata`` and their comments
    are looked up where they are defined.
    """
    for name in PUBLIC_MODULES:
        importlib.import_module(name)
    found: dict[tuple[str, int], list[str]] = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("fence") or module is None:
            continue
        try:
            attr_docs = ModuleAnalyzer.for_module(name).find_attr_docs()
        except PycodeError:
            continue
        for (scope, attr), lines in attr_docs.items():
            if not scope and hasattr(module, attr):
                found.setdefault((attr, id(getattr(module, attr))), list(lines))
    return found


_DOCS: dict[tuple[str, int], list[str]] = {}


def _fill_data_doc(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Give an exported constant the ``#:`` comment of its definition (autodoc would show
    the docstring of its type, ``str`` or ``int``)."""
    if what != "data":
        return
    attr = name.rpartition(".")[2]
    doc = _DOCS.get((attr, id(obj)))
    if doc is not None:
        lines[:] = [*doc, ""]


def _qualify_raises(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Point a bare exception name in a ``Raises:`` section at the ``fence`` export.

    ``fence.adapters.orm`` has a ``StaleTokenError`` of its own (a subclass), so a bare
    ``StaleTokenError`` elsewhere would have two targets. Where the documented object's
    module defines no class of that name, the name is ``fence``'s.
    """
    fence = sys.modules["fence"]
    module = next(
        (
            sys.modules[prefix]
            for prefix in _prefixes(name)
            if prefix in sys.modules and prefix in PUBLIC_MODULES
        ),
        None,
    )
    for i, line in enumerate(lines):
        match = _RAISES.match(line)
        if match is None:
            continue
        exc = match.group(2)
        if exc not in fence.__all__:
            continue
        own = getattr(module, exc, None) if module is not None else None
        if own is None or own is getattr(fence, exc):
            lines[i] = f"{match.group(1)}~fence.{exc}{match.group(3)}"


_RAISES = re.compile(r"^(\s*:raises )(\w+)(:.*)$", re.DOTALL)  # a field may span lines


def _prefixes(dotted: str) -> list[str]:
    parts = dotted.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def setup(app: Sphinx) -> dict[str, Any]:
    """Fill in the constants' comments, disambiguate ``Raises:`` names, and check that the
    API reference is complete after every build."""
    _DOCS.update(_defining_docs())
    app.connect("autodoc-process-docstring", _fill_data_doc)
    # After napoleon (priority 500) has turned ``Raises:`` into ``:raises X:`` fields.
    app.connect("autodoc-process-docstring", _qualify_raises, priority=600)
    app.connect("build-finished", _check_reference)
    return {"parallel_read_safe": True}
