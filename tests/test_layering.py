"""Layering of hf_megatron's packages: nothing imports upward.

Every module under hf_megatron/ is parsed with `ast` (imports inside functions and under
`if TYPE_CHECKING:` count too; relative imports are resolved), each import of a project module is
mapped to its unit (the longest prefix of the module name in LAYERS), and an edge is forbidden when
the imported unit sits in a higher layer than the importer's, or when the importer has a narrower
ONLY_FROM rule that leaves the imported unit out.  A module's imports of its own unit are always
allowed.  `from hf_megatron import X` / `import hf_megatron` means the package root, whose
__init__ imports the public API: it counts as the highest unit the root imports.
Edit the tables, not the checker.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT_PACKAGE = "hf_megatron"

LAYERS = [  # lowest first: a unit may import from its own layer or lower ones
    ["hf_megatron.errors"],
    ["hf_megatron.config", "hf_megatron.kernels"],
    ["hf_megatron.architectures"],
    ["hf_megatron.model"],
    ["hf_megatron.parallel"],
    ["hf_megatron.checkpoint"],
    ["hf_megatron.conversion", "hf_megatron.data", "hf_megatron.loading"],
    ["hf_megatron.training"],
    ["hf_megatron.integrations"],
    ["hf_megatron.commands", "hf_megatron.cli"],
]

ONLY_FROM = {  # narrower rules: the only other units these may import
    "hf_megatron.kernels": {"hf_megatron.errors"},
    "hf_megatron.model": {"hf_megatron.errors", "hf_megatron.config", "hf_megatron.kernels"},  # plain PyTorch
    "hf_megatron.data": {"hf_megatron.errors", "hf_megatron.config"},
}

EXEMPT = {"hf_megatron/__init__.py"}  # the public API re-exports from every layer


@dataclass(frozen=True)
class Edge:
    importer: str   # file, relative to the folder holding the package
    line: int
    imported: str   # the module as written, resolved to an absolute name
    reason: str

    def __str__(self) -> str:
        return f"{self.importer}:{self.line} -> {self.imported}  ({self.reason})"


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in `source`, wherever it sits in the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                submodule = f"{target}.{alias.name}"
                found.append((node.lineno, submodule if submodule in known else target))
    return sorted(set(found))


def forbidden_edges(base: Path, layers=LAYERS, only_from=ONLY_FROM, exempt=EXEMPT) -> list[Edge]:
    """Every forbidden import between units of the package folder `base / ROOT_PACKAGE`."""
    layer_of = {unit: index for index, units in enumerate(layers) for unit in units}

    def unit_of(name: str) -> str | None:
        candidates = [u for u in layer_of if name == u or name.startswith(u + ".")]
        return max(candidates, key=len) if candidates else None

    files = sorted(p for p in (base / ROOT_PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)
    known = {module_name(p, base) for p in files}
    graph = {}
    for path in files:
        module = module_name(path, base)
        project = [(line, name) for line, name in
                   imports_of(path.read_text(), module, path.name == "__init__.py", known)
                   if name == ROOT_PACKAGE or name.startswith(ROOT_PACKAGE + ".")]
        graph[path] = (module, project)

    root_imports = [name for path, (module, imported) in graph.items() if module == ROOT_PACKAGE
                    for _, name in imported if unit_of(name)]
    root_top = max(root_imports, key=lambda name: layer_of[unit_of(name)], default=None)

    edges = []
    for path, (module, imported) in graph.items():
        rel = path.relative_to(base).as_posix()
        if rel in exempt:
            continue
        unit = unit_of(module)
        if unit is None:
            edges.append(Edge(rel, 1, module, f"{module} is in no layer: add it to LAYERS"))
            continue
        for line, name in imported:
            if name == ROOT_PACKAGE:
                if root_top is None:
                    continue
                target, via = unit_of(root_top), f"the package root, which imports {root_top}"
            else:
                target, via = unit_of(name), None
            if target is None:
                edges.append(Edge(rel, line, name, f"{name} is in no layer: add it to LAYERS"))
                continue
            if target == unit:
                continue
            what = f"{unit} (layer {layer_of[unit]}) may not import {target} (layer {layer_of[target]})"
            if via:
                what += f": {via}"
            if layer_of[target] > layer_of[unit]:
                edges.append(Edge(rel, line, name, what))
            elif unit in only_from and target not in only_from[unit]:
                allowed = ", ".join(sorted(only_from[unit])) or "nothing"
                edges.append(Edge(rel, line, name, f"{unit} may import only {allowed}, not {target}"
                                  + (f": {via}" if via else "")))
    return edges


def _report(edges: list[Edge]) -> str:
    return f"{len(edges)} forbidden import(s):\n" + "\n".join(f"  {edge}" for edge in edges)


def test_no_module_imports_upward():
    edges = forbidden_edges(Path(__file__).resolve().parents[1])
    assert not edges, _report(edges)


def _write_package(base: Path, files: dict[str, str]) -> None:
    for rel, source in files.items():
        path = base / ROOT_PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_checker_catches_forbidden_edges_and_allows_the_rest(tmp_path):
    _write_package(tmp_path, {
        "__init__.py": "from .training import train\n",                        # exempt
        "errors.py": "",
        "config.py": "from .errors import HFMegatronError\nfrom . import kernels\n",  # same layer: fine
        "kernels/__init__.py": """\
            from .build import load_extension      # own unit
            def later():
                from ..model import gpt             # inside a function, upward
        """,
        "kernels/build.py": "from hf_megatron.errors import HFMegatronError\n",
        "model/__init__.py": "",
        "model/gpt.py": """\
            import torch
            from .. import kernels                   # allowed by ONLY_FROM
            from ..architectures import plan         # lower layer, but not in model's ONLY_FROM
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from ..parallel.state import Grid    # type-only still counts
        """,
        "architectures/__init__.py": "", "architectures/plan.py": "",
        "parallel/__init__.py": "", "parallel/state.py": "",
        "data/__init__.py": "from hf_megatron import __version__\n",  # the root imports training
        "training/__init__.py": "from ..data import loader\ntrain = None\n", "data/loader.py": "",
        "newthing.py": "",
    })
    found = {(edge.importer, edge.line, edge.imported) for edge in forbidden_edges(tmp_path)}
    assert found == {
        ("hf_megatron/kernels/__init__.py", 3, "hf_megatron.model.gpt"),
        ("hf_megatron/model/gpt.py", 3, "hf_megatron.architectures.plan"),
        ("hf_megatron/model/gpt.py", 6, "hf_megatron.parallel.state"),
        ("hf_megatron/data/__init__.py", 1, "hf_megatron"),
        ("hf_megatron/newthing.py", 1, "hf_megatron.newthing"),
    }, found
    message = _report(forbidden_edges(tmp_path))
    assert "hf_megatron/model/gpt.py:6 -> hf_megatron.parallel.state  (hf_megatron.model (layer 3) may not import " \
           "hf_megatron.parallel (layer 4))" in message, message
    assert "the package root, which imports hf_megatron.training" in message, message
