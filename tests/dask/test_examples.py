"""The example notebooks run as a user runs them, each in a real Jupyter kernel (nbclient).
(examples/existing_cluster.py runs in tests/dask/test_install.py, against its `dask` CLI cluster.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
# What each notebook prints when it worked (its own asserts ran before).
CHECKS = {"quickstart": "identical to the unmoved run", "batch": "200 prompts scored"}


def test_there_are_notebooks_and_they_are_committed_without_outputs():
    assert NOTEBOOKS, f"no notebooks in {EXAMPLES}"
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: outputs in git"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_notebook_runs_top_to_bottom(path, tmp_path):
    assert CHECKS[path.stem] in run_notebook(path, tmp_path)


def run_notebook(path: Path, cwd: Path) -> str:
    """Execute the notebook in a real kernel; what it printed. Fails on any cell's error.
    (The quickstart's `ENGINE = "vllm"` is not run here: the same client, stream and migration
    calls on vLLM instances are tests/vllm/test_dask_vllm.py's.)"""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")

