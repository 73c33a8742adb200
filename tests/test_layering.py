"""The core stays pure: llumdask/ never imports the Dask, HTTP or dashboard layers, and only
llumdask/engine/ touches torch or vllm. Lazy imports inside functions count too.

plugins/, api/, clusters/ and benchmarks/ are installed inside the package (as llumdask.plugins,
.api, .clusters, .benchmarks) but live outside llumdask/ on disk, so walking the folder finds exactly the core, and
every import is resolved to its full module path (relative ones too): the core importing
``llumdask.api.x`` is as wrong as importing starlette itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "llumdask"
ENGINE = CORE / "engine"

NEVER_IN_CORE = frozenset({"distributed", "starlette", "bokeh", "uvicorn", "matplotlib",
                           "llumdask.plugins", "llumdask.api", "llumdask.clusters", "llumdask.benchmarks"})
ENGINE_ONLY = frozenset({"torch", "vllm"})
# The package's front door: `llumdask.connect` names the notebook client (imported when first
# used, so importing the core never imports Dask). Nothing else in the core may.
FRONT_DOOR = {"__init__.py": frozenset({"llumdask.api.client"})}


def imported_modules(source: str, filename: str = "<source>", package: str = "") -> set[str]:
    """Full names of the modules a module imports, anywhere in its body; relative imports are
    resolved against `package` (the importing module's package)."""
    modules = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            modules.add(module)
    return modules


def _within(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def forbidden_imports(path: Path, engine: Path = ENGINE, core: Path = CORE) -> set[str]:
    """What `path` (a module of the core) imports that its place in the layers forbids."""
    forbidden = NEVER_IN_CORE if path.is_relative_to(engine) else NEVER_IN_CORE | ENGINE_ONLY
    package = ".".join(("llumdask", *path.parent.relative_to(core).parts))
    allowed = FRONT_DOOR.get(path.relative_to(core).as_posix(), frozenset())
    return {m for m in imported_modules(path.read_text(), str(path), package)
            if m not in allowed and any(_within(m, layer) for layer in forbidden)}


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
        "from ..api import client\n"
        "def later():\n"
        "    import torch\n"
        "    from vllm import LLM\n"
    )
    assert imported_modules(source, package="llumdask.sim") == {
        "os", "distributed.comm", "starlette.routing", "llumdask.sim", "llumdask.sim.engine", "llumdask.api",
        "torch", "vllm"}


def test_torch_is_allowed_only_under_engine_and_the_outer_layers_nowhere(tmp_path):
    core = tmp_path / "llumdask"
    (core / "engine").mkdir(parents=True)
    inside, outside = core / "engine" / "model.py", core / "scheduler.py"
    for path, up in ((inside, ".."), (outside, ".")):  # both name llumdask.api relatively
        path.write_text(f"import torch\nimport bokeh.plotting\nfrom llumdask.plugins import worker\nfrom {up}api import serve\n")
    layers = {"bokeh.plotting", "llumdask.plugins", "llumdask.api"}
    assert forbidden_imports(inside, engine=core / "engine", core=core) == layers
    assert forbidden_imports(outside, engine=core / "engine", core=core) == layers | {"torch"}
    # llumdask.policy is the core: a name sharing a layer's prefix is not that layer.
    outside.write_text("import llumdask.apis\nfrom llumdask import policy\n")
    assert forbidden_imports(outside, engine=core / "engine", core=core) == set()


# What turns bytes into running code or arbitrary objects: nothing an HTTP client sends may reach one.
UNPICKLERS = frozenset({"pickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle", "distributed.protocol"})
GATEWAY = CORE.parent / "api" / "gateway"


@pytest.mark.parametrize("path", sorted(GATEWAY.rglob("*.py")), ids=lambda p: p.relative_to(GATEWAY).as_posix())
def test_the_http_gateway_never_imports_an_unpickler(path):
    package = ".".join(("llumdask", *path.parent.relative_to(CORE.parent).parts))
    imported = imported_modules(path.read_text(), str(path), package)
    assert {m for m in imported if any(_within(m, u) for u in UNPICKLERS)} == set()
