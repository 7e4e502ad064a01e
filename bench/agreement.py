"""Greedy-token agreement of each quantized KV profile with BF16 on the demo workload.

The demo (``ninfer_kv.demo``) serves the same requests with the same model weights once per KV
profile; every run is first checked against its own dense reference (``dense_match``).  Then,
against the BF16 run:

* free-running agreement: the fraction of generated positions whose token equals BF16's at the
  same position (a request that diverges once usually keeps diverging), the fraction of requests
  whose whole generation is identical, and the mean length of the common prefix as a fraction of
  the generation;
* teacher-forced top-1 agreement: over the BF16 run's own sequences, the fraction of positions
  where the profile's greedy token (dense model with the profile's codec round trip, proven equal
  to the paged path by ``dense_match``) equals BF16's, and the largest logit difference there.

    PYTHONPATH=. python bench/agreement.py                      # small model, 32 requests, 24 tokens
    PYTHONPATH=. python bench/agreement.py --requests 64 --max-new-tokens 48 --seed 1
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from ninfer_kv.cli import render_table  # noqa: E402
from ninfer_kv.demo import DemoConfig, WorkloadSpec, run_demo  # noqa: E402
from ninfer_kv.demo.dense_check import dense_generation_logits  # noqa: E402
from ninfer_kv.demo.drafter import demo_params as _params  # noqa: E402
from ninfer_kv.schema.profiles import KVProfile  # noqa: E402


def teacher_forced(config: DemoConfig, records, profile: KVProfile):
    """(agreeing positions, positions, max |log-probability diff|) of ``profile`` over BF16's sequences
    (against the log-probabilities the BF16 run reported for its tokens and their top alternatives)."""
    model = config.model_config
    params, _ = _params(model, config.seed)
    agree = total = 0
    max_diff = 0.0
    for r, mine in dense_generation_logits(params, model, profile, records):
        agree += int(np.sum(np.argmax(mine, axis=-1) == r.generated))
        total += r.generated.size
        z = mine.astype(np.float64) - mine.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        for j, served in enumerate(r.logprobs):
            for token, value in served.items():
                max_diff = max(max_diff, abs(value - float(logp[j, token])))
    return agree, total, max_diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    workload = WorkloadSpec(requests=args.requests, max_new_tokens=args.max_new_tokens, seed=args.seed)
    runs = {}
    for profile in KVProfile:
        config = DemoConfig(workload=workload, model=args.model, profile=profile, seed=args.seed)
        t0 = time.perf_counter()
        result = run_demo(config, progress=False)
        runs[profile] = (config, result)
        print(
            f"{profile.value:18s} served {result['generated_tokens']} tokens in {time.perf_counter() - t0:5.1f} s; "
            f"dense_match {result['dense_match']} (max |logit diff| {result['dense']['max_abs_logit_diff']:.1e})",
            flush=True,
        )
        if not result["dense_match"]:
            raise SystemExit(f"{profile.value}: the served tokens differ from the dense reference")

    base_config, base = runs[KVProfile.BF16]
    ref = {r.request.id: r.generated for r in base.records}
    rows = []
    for profile, (config, result) in runs.items():
        if profile is KVProfile.BF16:
            continue
        same_pos = total = identical = 0
        prefix_frac = []
        for r in result.records:
            a, b = r.generated, ref[r.request.id]
            n = min(a.size, b.size)
            eq = a[:n] == b[:n]
            same_pos += int(eq.sum())
            total += b.size
            identical += int(a.size == b.size and bool(eq.all()))
            first = int(np.argmin(eq)) if not eq.all() else n
            prefix_frac.append(first / b.size)
        agree, positions, max_diff = teacher_forced(base_config, base.records, profile)
        rows.append(
            [
                profile.value,
                f"{same_pos / total:.1%}",
                f"{identical}/{len(ref)}",
                f"{np.mean(prefix_frac):.1%}",
                f"{agree / positions:.2%}",
                f"{max_diff:.3f}",
            ]
        )
    print()
    print(
        f"greedy-token agreement with bf16: model {args.model}, {args.requests} requests, up to "
        f"{args.max_new_tokens} new tokens, seed {args.seed}, {sum(r.size for r in ref.values())} bf16 tokens"
    )
    print(
        render_table(
            ["profile", "free-running tokens", "identical requests", "common prefix", "teacher-forced top-1",
             "max |logit diff|"],
            rows,
            right=(1, 2, 3, 4, 5),
        )
    )


if __name__ == "__main__":
    main()
