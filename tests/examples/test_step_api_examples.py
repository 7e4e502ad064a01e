"""The step examples: each needs at most ten names, all imported from ``ninfer_kv``, and the Flax NNX
one runs and checks itself against its dense forward."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEP_EXAMPLES = ("step_function.py", "flax_nnx_step.py")
MAX_NAMES = 10


def package_names(source: str) -> tuple[set[str], list[str]]:
    """``(names, problems)``: the names a script takes from ``ninfer_kv`` (``from ninfer_kv import
    x`` and the attributes of an ``import ninfer_kv``), and every import of a ``ninfer_kv``
    submodule (the short way needs none)."""
    tree = ast.parse(source)
    names, problems, modules = set(), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ninfer_kv":
            if node.module != "ninfer_kv" or node.level:
                problems.append(f"line {node.lineno}: from {node.module} import ...")
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ninfer_kv":
                    if a.name != "ninfer_kv":
                        problems.append(f"line {node.lineno}: import {a.name}")
                    modules.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            names.add(node.attr)
    return names, problems


@pytest.mark.parametrize("script", STEP_EXAMPLES)
def test_a_step_example_needs_at_most_ten_names_from_the_facade(script):
    names, problems = package_names((ROOT / "examples" / script).read_text())
    assert not problems, f"{script} imports ninfer_kv submodules: {problems}"
    assert 0 < len(names) <= MAX_NAMES, f"{script} uses {len(names)} names: {sorted(names)}"
    import ninfer_kv

    assert all(n in ninfer_kv.__all__ for n in names), sorted(set(names) - set(ninfer_kv.__all__))


def test_the_name_count_can_fail():
    names, problems = package_names(
        "import ninfer_kv\nfrom ninfer_kv.device import apply_work\nfrom ninfer_kv import ops, KVStore\n"
        "ninfer_kv.begin_step(1)\n"
    )
    assert names == {"apply_work", "ops", "KVStore", "begin_step"}
    assert problems == ["line 2: from ninfer_kv.device import ..."]


def test_flax_nnx_example_runs():
    pytest.importorskip("flax")
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "flax_nnx_step.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("ok: a Flax NNX model decoded 8 tokens for 2 prompts")
