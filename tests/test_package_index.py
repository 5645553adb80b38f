"""Every package's ``__init__`` names exactly the modules it holds (its index), and the renamed public
modules still import under their old names, with a DeprecationWarning, for one release.

The index format, read here: one paragraph of the ``__init__`` docstring starts with the line
``Modules:``; each entry is a line ``- NAME: what it is for`` (``NAME/`` for a subpackage), a long
one continued on lines indented by two spaces; the paragraph ends at the first blank line. Dunder
modules (``__main__``) are not listed: the docstring's first line says how to run the package.
"""
import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from tests.mpirun import ROOT
from tests.test_architecture import LAYERS, graph

PACKAGE = ROOT / "zerompi"
ENTRY = re.compile(r"- ([a-z_][a-z0-9_]*/?): \S")
# Old module name -> new one: public modules renamed, importable under the old name until the next release.
RENAMED_PUBLIC = {"zerompi.pipeline.simulate": "zerompi.pipeline.timeline",
                  "zerompi.comm.simulated": "zerompi.comm.simulated_world"}


def packages():
    """{dotted name: folder} of every package, the top-level one included."""
    return {".".join(init.parent.relative_to(ROOT).parts): init.parent for init in sorted(PACKAGE.rglob("__init__.py"))}


def present(folder: Path):
    """The module names an index must list: NAME for NAME.py, NAME/ for a subpackage."""
    names = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")}
    names |= {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return names


def index(doc: str):
    """The NAMEs of the docstring's ``Modules:`` paragraph, in order; None when it has none."""
    lines = doc.splitlines()
    if "Modules:" not in lines:
        return None
    listed = []
    for line in lines[lines.index("Modules:") + 1:]:
        if not line.strip():
            break
        m = ENTRY.match(line)
        assert m or line.startswith("  "), f"not an index entry nor its continuation: {line!r}"
        if m:
            listed.append(m.group(1))
    return listed


def docstring(folder: Path) -> str:
    return ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""


@pytest.mark.parametrize("name", sorted(packages()))
def test_index_names_exactly_the_modules_there(name):
    folder = packages()[name]
    listed = index(docstring(folder))
    assert listed is not None, f"{name}/__init__.py has no 'Modules:' index"
    assert len(listed) == len(set(listed)), f"{name}: listed twice: {sorted(n for n in listed if listed.count(n) > 1)}"
    there = present(folder)
    assert not set(listed) - there, f"{name}'s index names modules that are not there: {sorted(set(listed) - there)}"
    assert not there - set(listed), f"{name}'s index misses modules: {sorted(there - set(listed))}"


def test_top_level_index_is_in_layer_order():
    order = [n.rstrip("/") for n in index(docstring(PACKAGE))]
    assert order == [n for layer in LAYERS for n in sorted(layer, key=order.index)], order


def test_index_parser_catches_both_mistakes(tmp_path):
    (tmp_path / "pkg").mkdir()
    for name in ("__init__", "__main__", "a", "b"):
        (tmp_path / "pkg" / f"{name}.py").write_text("")
    (tmp_path / "pkg" / "sub").mkdir()
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    assert present(tmp_path / "pkg") == {"a", "b", "sub/"}
    doc = "Title.\n\nModules:\n- a: one\n  more of a\n- gone: not there\n\nMay import: x."
    assert index(doc) == ["a", "gone"]
    assert index("Title.\n\nNo index here.") is None
    with pytest.raises(AssertionError):
        index("Modules:\na: not an entry")


@pytest.mark.parametrize("old,new", sorted(RENAMED_PUBLIC.items()))
def test_renamed_public_modules_still_import_and_warn(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        shim = importlib.import_module(old)
    module = importlib.import_module(new)
    assert shim.__all__ and all(getattr(shim, n) is getattr(module, n) for n in shim.__all__)


def test_nothing_inside_the_package_imports_a_deprecated_name():
    users = {name: sorted(set(RENAMED_PUBLIC) & deps) for name, deps in graph().items()}
    assert not {name: old for name, old in users.items() if old}
