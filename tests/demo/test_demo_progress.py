"""The demo's progress bar: a tqdm bar on stderr that shows when XLA is compiling."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv.demo.progress import DemoProgress, make_progress


def _fresh_compile(scale: float) -> None:
    """Compile a function XLA has never seen in this process (a new constant each time)."""
    jax.jit(lambda x: jnp.tanh(x) * scale + scale)(np.arange(3, dtype=np.float32)).block_until_ready()


def test_bar_counts_requests_and_shows_facts():
    stream = io.StringIO()
    bar = make_progress(3, stream=stream)
    assert isinstance(bar, DemoProgress)
    bar.update(1, tokens=5)
    bar.update(2, tokens=9)
    bar.close()
    text = stream.getvalue()
    assert "3/3" in text and "tokens=9" in text and "serving requests" in text
    assert bar.n == 3 and bar.phase == "serving"


def test_bar_shows_the_compile_phase_while_open_only():
    stream = io.StringIO()
    bar = make_progress(2, stream=stream)
    _fresh_compile(1.25)
    text = stream.getvalue()
    assert "now=compiling" in text, text  # drawn when lowering ends and the backend compile starts
    assert text.rindex("now=serving") > text.index("now=compiling")  # and back once it is compiled
    assert bar.phase == "serving" and bar.compiles >= 1 and bar.compile_seconds > 0
    bar.update(2, tokens=4)
    bar.close()
    compiles = bar.compiles
    _fresh_compile(2.5)  # after close the bar no longer listens
    assert bar.compiles == compiles
    assert "compiled=" in stream.getvalue() and "2/2" in stream.getvalue()


def test_disabled_progress_is_silent(capsys):
    bar = make_progress(5, enabled=False)
    bar.update(1, tokens=3)
    bar.close()
    assert capsys.readouterr().err == ""
