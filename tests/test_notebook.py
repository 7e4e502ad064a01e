"""``examples/layouts.ipynb`` is stored executed (outputs and figures included) and still executes
cleanly, headless, with this interpreter, to the same printed results."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install '.[test]')")
nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install '.[test]')")
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install '.[test]')")
pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install '.[test]')")
jupyter_client = pytest.importorskip("jupyter_client", reason="jupyter_client is not installed")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "layouts.ipynb"


def _stream_text(nb) -> list[str]:
    return ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream")
            for c in nb.cells if c.cell_type == "code"]


def test_notebook_is_stored_with_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run every cell once, in order"
    for c in code:
        assert not [o for o in c.outputs if o.get("output_type") == "error"]
        if "plt.subplots" in c.source:
            assert any("image/png" in o.get("data", {}) for o in c.outputs), c.source[:60]
    assert "block table, entries coloured by the owner of their page" in nb.cells[11].source


def _kernel_manager(env: dict):
    """A python3 kernel launched by exactly this interpreter (never another python on PATH)."""
    km = jupyter_client.KernelManager(kernel_name="python3")
    spec = km.kernel_spec
    spec.argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.env = env
    return km


def test_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    probe = nbformat.v4.new_code_cell("import sys; print(sys.executable)")
    nb.cells.insert(0, probe)
    env = {
        "MPLBACKEND": "Agg",
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    client = nbclient.NotebookClient(
        nb, km=_kernel_manager(env), timeout=120, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    ran = probe.outputs[0]["text"].strip()
    assert os.path.realpath(ran) == os.path.realpath(sys.executable)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "k8v4  page-major page bytes  823,296" in text
    assert "2 shared pages" in text
    nb.cells.remove(probe)
    stored = nbformat.read(NOTEBOOK, as_version=4)
    assert _stream_text(nb) == _stream_text(stored), "the stored outputs are stale: re-execute and save the notebook"
