"""Sphinx configuration: MyST pages plus the API reference from the docstrings."""

import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))  # the checkout's tev_jax, as the tests import it
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "tev-jax"
author = "the tev-jax authors"
copyright = "the tev-jax authors, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings are Google style
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_autosummary/*.md"]
myst_heading_anchors = 3

# Every public module gets a page (autosummary walks the package recursively, so a new
# module is documented without editing api.md); members in source order.
autosummary_generate = True
templates_path = ["_templates"]  # module pages: the module's docstring and members only
autodoc_default_options = {"members": True, "member-order": "bysource",
                           "show-inheritance": False}
autodoc_typehints = "none"  # the signatures show them; the docstrings name the shapes
autodoc_mock_imports = ["hypothesis"]  # tev_jax.testing.strategies, without the test extra
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = False
# `name` in a docstring links to that object when it resolves and reads as code otherwise.
default_role = "py:obj"

html_theme = "alabaster"
html_title = "tev-jax"


# The docstrings are written to read well as plain text: Google sections, markdown pipe
# tables, shapes with starred leading axes (``[*X, N]``), hanging indents in Returns.
# Three rewrites make that valid reST, without editing it or hiding warnings.
_STAR = re.compile(r"\[\*")
_SECTION = re.compile(r"^\s*(Returns|Yields):\s*$")


def _rest(app, what, name, obj, options, lines):
    out, in_table, returns_indent = [], False, None
    for line in lines:
        parts = line.split("``")  # odd parts are inline literals: left as they are
        line = "``".join(_STAR.sub(r"[\\*", x) if i % 2 == 0 else x
                         for i, x in enumerate(parts))
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if stripped.startswith("|") and stripped.rstrip().endswith("|"):
            if not in_table:  # a markdown table becomes a literal block
                out += ["", "::", ""] if out and out[-1].strip() else ["::", ""]
                in_table = True
            out.append("    " + line)
            continue
        if in_table:
            out.append("")
            in_table = False
        if _SECTION.match(line):
            returns_indent = -1
        elif returns_indent is not None and stripped:
            if returns_indent == -1:
                returns_indent = indent
            elif indent < returns_indent:
                returns_indent = None  # the section ended
            else:
                line = " " * returns_indent + stripped  # no hanging indent
        out.append(line)
    lines[:] = out


def setup(app):
    app.connect("autodoc-process-docstring", _rest, priority=100)  # before napoleon
