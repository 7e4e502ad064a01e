"""What the FFI kernels' arithmetic adds to a model's logits, against what the codec itself does.

A Qwen3-like float32 decoder (random weights; ``--layers``, head dim 128, QK norm) runs 4 rows of a
``--prompt``-token prompt (chunked prefill) and 8 teacher-forced decode steps through the paged
steps, once per (profile, implementation).  Printed per profile:

* ``ffi vs reference``: the largest |logit| difference between ``impl="ffi"`` and
  ``impl="reference"`` over the same quantized cache: what the FFI's products add, amplified
  through the layers (a tiny difference in one layer's output can move the next layer's K/V to a
  neighbouring code);
* ``codec effect``: the largest |logit| difference between the profile and BF16, both with the
  reference ops;
* their ratio (the rule of docs/ACCURACY.md: at most a tenth).

Run it at the level in use, and with ``NINFER_KV_FFI_ISA=avx512`` for float32 products everywhere::

    PYTHONPATH=. python bench/accuracy_model.py
    NINFER_KV_FFI_ISA=avx512 PYTHONPATH=. python bench/accuracy_model.py --profiles nvfp4-g16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "examples"))
from model_harness import prefill  # noqa: E402

from ninfer_kv.ops.ffi import handlers as ffi_handlers  # noqa: E402
from ninfer_kv.models.decoder import ModelConfig, StepConfig, init_params, make_steps  # noqa: E402
from ninfer_kv.ops.views import allocate_planes  # noqa: E402

ROWS, DECODES = 4, 8


def logits(cfg, params, prompt, profile: str, impl: str) -> np.ndarray:
    steps = make_steps(StepConfig(model=cfg, profile=profile, impl=impl, batch_buckets=(ROWS,)))
    blocks = -(-(prompt.shape[1] + DECODES) // 64)
    tables = np.arange(ROWS * blocks, dtype=np.int32).reshape(ROWS, blocks)
    planes = allocate_planes(steps.config.main_layout, ROWS * blocks + 1)
    planes, first = prefill(steps, params, planes, tables, prompt, list(range(ROWS)))
    out, tok = [np.asarray(first.logits)], prompt[:, -1].copy()
    for i in range(DECODES):  # teacher-forced: the same tokens whatever the logits
        o = steps.decode(params, planes, jnp.asarray(tables), tok[:, None], np.full(ROWS, prompt.shape[1] + i, np.int32),
                         np.ones(ROWS, np.int32), np.arange(ROWS, dtype=np.int32))
        planes = o.planes
        out.append(np.asarray(o.logits))
        tok = (tok + 7) % cfg.vocab_size
    return np.stack(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiles", nargs="+", default=["int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt", type=int, default=300)
    args = p.parse_args(argv)
    cfg = ModelConfig(vocab_size=1024, d_model=512, num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=128,
                      mlp_dim=1024, qk_norm=True, rope_theta=1e6, dtype="float32")
    params = init_params(cfg, seed=0)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, (ROWS, args.prompt)).astype(np.int32)
    print(f"FFI level {ffi_handlers.info().isa}; {args.layers} layers, prompt {args.prompt}, {DECODES} decode steps")
    base = logits(cfg, params, prompt, "bf16", "reference")
    print("| profile | arithmetic (scores / values) | ffi vs reference | codec effect | ratio |")
    print("|---|---|---|---|---|")
    for profile in args.profiles:
        ref = logits(cfg, params, prompt, profile, "reference")
        ffi = logits(cfg, params, prompt, profile, "ffi")
        added, codec = float(np.abs(ffi - ref).max()), float(np.abs(ref - base).max())
        ar = ffi_handlers.arithmetic(profile, cfg.head_dim)
        print(f"| {profile} | {ar.scores} / {ar.values} | {added:.2e} | {codec:.2e} | 1/{codec / max(added, 1e-30):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
