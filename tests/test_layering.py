"""The core stays pure: llumdask/ never imports the Dask, HTTP or dashboard layers, and only
llumdask/engine/ touches torch or vllm. Lazy imports inside functions count too.

plugins/, api/ and clusters/ (installed as llumdask.plugins, .api, .clusters) live outside
llumdask/ on disk, so walking the folder checks exactly the core.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "llumdask"
ENGINE = CORE / "engine"

NEVER_IN_CORE = frozenset({"distributed", "starlette", "bokeh", "uvicorn"})
ENGINE_ONLY = frozenset({"torch", "vllm"})


def imported_roots(source: str, filename: str = "<source>") -> set[str]:
    """Top-level package names a module imports absolutely, anywhere in its body."""
    roots = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.partition(".")[0])
    return roots


def forbidden_imports(path: Path, engine: Path = ENGINE) -> set[str]:
    """What `path` (a module of the core) imports that its place in the layers forbids."""
    forbidden = NEVER_IN_CORE if path.is_relative_to(engine) else NEVER_IN_CORE | ENGINE_ONLY
    return imported_roots(path.read_text(), str(path)) & forbidden


def core_modules() -> list[Path]:
    return sorted(CORE.rglob("*.py"))


def test_core_modules_are_found():
    names = {p.relative_to(CORE).as_posix() for p in core_modules()}
    assert {"__init__.py", "config.py", "request.py"} <= names


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.relative_to(CORE).as_posix())
def test_core_module_respects_the_layers(path):
    assert forbidden_imports(path) == set()


def test_checker_sees_every_import_form():
    source = (
        "import os, distributed.comm\n"
        "from starlette.routing import Route\n"
        "from . import sibling\n"
        "from .engine import base\n"
        "def later():\n"
        "    import torch\n"
        "    from vllm import LLM\n"
    )
    assert imported_roots(source) == {"os", "distributed", "starlette", "torch", "vllm"}


def test_torch_is_allowed_only_under_engine(tmp_path):
    core = tmp_path / "llumdask"
    (core / "engine").mkdir(parents=True)
    inside, outside = core / "engine" / "model.py", core / "scheduler.py"
    for path in (inside, outside):
        path.write_text("import torch\nimport bokeh.plotting\n")
    assert forbidden_imports(inside, engine=core / "engine") == {"bokeh"}
    assert forbidden_imports(outside, engine=core / "engine") == {"bokeh", "torch"}
