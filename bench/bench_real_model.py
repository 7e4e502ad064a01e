"""A Qwen3-0.6B-shaped model (random weights, bfloat16) on the CPU: decode through the paged store vs
transformers' ``generate`` with its default cache, and checkpoint load time vs reading its bytes.

Steps, side by side in one process:

1. write a checkpoint of Qwen3-0.6B's ``config.json`` with random weights (``save_random_checkpoint``,
   bf16, 1.2 GB; ``--checkpoint DIR`` reuses one);
2. load time: read every shard's bytes into memory (the floor: what loading must at least do), then
   ``ninfer_kv.models.hf.load_checkpoint`` (headers, checks, copies to device arrays), alternated
   ``--load-rounds`` times, best of each (the files are in the page cache for both);
3. one ``--context``-token prompt is prefilled once on each side: the paged generator retains it as a
   checkpoint (its last token left out), transformers keeps its ``DynamicCache``;
4. for each batch size B: B sequences continue the prompt, each generating ``--new-tokens`` greedy
   tokens.  Paged: B forks of the checkpoint (shared full pages, one COW tail page each), decoded in
   batches through the store (map -> take_step_work -> one dispatch -> commit per round, host
   bookkeeping included).  transformers: ``model.generate`` on the B-row prompt with the prefilled
   cache repeated B times (its default ``DynamicCache``).  Both first process the prompt's last token,
   then decode; a warm-up run of each (compiles, allocator) is not timed; the timed runs alternate and
   the best of ``--rounds`` is reported.  The greedy tokens of both are compared (bf16: equal up to
   near ties of transformers' bfloat16 logits).

    PYTHONPATH=. python bench/bench_real_model.py --batches 1,8 --context 2048 --new-tokens 32
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ninfer_kv.models.generate import PagedGenerator  # noqa: E402
from ninfer_kv.models.hf import load_checkpoint, save_random_checkpoint  # noqa: E402
from ninfer_kv.models.hf.published_configs import QWEN3_0_6B  # noqa: E402
from ninfer_kv.ops import resolve_impl  # noqa: E402


def read_bytes(directory: Path) -> tuple[float, int]:
    """Seconds to read every ``*.safetensors`` file of ``directory`` into memory, and the bytes read."""
    start = time.perf_counter()
    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        buf = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as f:
            total += f.readinto(buf)
        del buf
    return time.perf_counter() - start, total


class PagedSide:
    """The paged generator holding the prefilled prompt as a checkpoint."""

    def __init__(self, params, config, prompt: list[int], max_batch: int, new_tokens: int, profile: str):
        context = len(prompt) + new_tokens + 1
        # one row more than the largest batch: its default capacity then also holds the retained prompt
        self.gen = PagedGenerator(params, config, profile=profile, max_context=context, max_batch=max_batch + 1)
        self.prompt = prompt
        start = time.perf_counter()
        self.parent = self.gen.add(prompt[:-1], max_new_tokens=1, retain=True)
        self.gen.run()
        self.prefill_seconds = time.perf_counter() - start

    def run(self, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
        seqs = [self.gen.add(self.prompt, max_new_tokens=new_tokens, source=self.parent) for _ in range(batch)]
        start = time.perf_counter()
        self.gen.run()
        return time.perf_counter() - start, [s.generated for s in seqs]


class TransformersSide:
    """transformers' model on the same checkpoint, its DynamicCache prefilled with the prompt's prefix."""

    def __init__(self, directory: Path, prompt: list[int]):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
        self.prompt = prompt
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model(torch.tensor([prompt[:-1]]), use_cache=True)
        self.cache = out.past_key_values
        self.prefill_seconds = time.perf_counter() - start

    def run(self, batch: int, new_tokens: int) -> tuple[float, list[list[int]]]:
        torch = self.torch
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(batch)
        ids = torch.tensor([self.prompt] * batch)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0)
        seconds = time.perf_counter() - start
        return seconds, out[:, len(self.prompt):].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None, help="reuse a checkpoint directory (default: write one)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load-rounds", type=int, default=3)
    ap.add_argument("--profile", default="bf16")
    ap.add_argument("--no-transformers", action="store_true", help="paged side only")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = resolve_impl("auto").name
    print(f"device {jax.devices()[0].platform}, impl {impl}, profile {args.profile}, context {args.context}, "
          f"new tokens {args.new_tokens}, batches {batches}")

    tmp = None
    directory = args.checkpoint
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="qwen3-0.6b-random-")
        directory = Path(tmp.name)
        start = time.perf_counter()
        save_random_checkpoint(directory, QWEN3_0_6B, seed=0)
        print(f"wrote a Qwen3-0.6B-shaped checkpoint (random weights, bf16) in {time.perf_counter() - start:.1f} s")

    # -- load time vs reading the bytes ------------------------------------------------------------------
    reads, loads = [], []
    model = None
    for _ in range(args.load_rounds):
        seconds, nbytes = read_bytes(directory)
        reads.append(seconds)
        model = None
        model = load_checkpoint(directory, dtype="bfloat16", max_context=args.context + args.new_tokens + 1)
        loads.append(model.load_seconds)
    read_s, load_s = min(reads), min(loads)
    print(f"\ncheckpoint {nbytes / 1e9:.3f} GB: read bytes {read_s:.3f} s ({nbytes / read_s / 1e9:.2f} GB/s), "
          f"load_checkpoint {load_s:.3f} s ({model.bytes_read / load_s / 1e9:.2f} GB/s) = {load_s / read_s:.2f}x the read")

    rng = np.random.default_rng(0)
    prompt = rng.integers(1, QWEN3_0_6B["vocab_size"], args.context).tolist()
    paged = PagedSide(model.params, model.config, prompt, max(batches), args.new_tokens, args.profile)
    print(f"prefill of {args.context - 1} tokens: paged {paged.prefill_seconds:.1f} s (compiles included)", end="")
    hf = None
    if not args.no_transformers:
        hf = TransformersSide(directory, prompt)
        print(f", transformers {hf.prefill_seconds:.1f} s", end="")
    print()

    rows = []
    for b in batches:
        paged.run(b, 3)  # warm-up: compiles the batch's buckets
        if hf is not None:
            hf.run(b, 3)
        best_p, best_h, toks_p, toks_h = float("inf"), float("inf"), None, None
        for _ in range(args.rounds):
            s, toks_p = paged.run(b, args.new_tokens)
            best_p = min(best_p, s)
            if hf is not None:
                s, toks_h = hf.run(b, args.new_tokens)
                best_h = min(best_h, s)
        tps_p = b * args.new_tokens / best_p
        row = {"batch": b, "paged_tokens_per_s": tps_p, "paged_seconds": best_p}
        if hf is not None:
            tps_h = b * args.new_tokens / best_h
            same = sum(int(x == y) for p_, h_ in zip(toks_p, toks_h) for x, y in zip(p_, h_))
            first = [next((i for i, (x, y) in enumerate(zip(p_, h_)) if x != y), len(p_)) for p_, h_ in zip(toks_p, toks_h)]
            row.update(transformers_tokens_per_s=tps_h, transformers_seconds=best_h, ratio=tps_p / tps_h,
                       tokens_equal_before_first_difference=min(first))
        rows.append(row)
        print(f"batch {b}: {json.dumps(row)}", flush=True)
    print()
    print(f"{'batch':>5}  {'paged tok/s':>11}  {'transformers tok/s':>18}  {'ratio':>6}  equal prefix")
    for r in rows:
        if "ratio" in r:
            print(f"{r['batch']:>5}  {r['paged_tokens_per_s']:>11.2f}  {r['transformers_tokens_per_s']:>18.2f}  "
                  f"{r['ratio']:>5.2f}x  {r['tokens_equal_before_first_difference']}/{args.new_tokens}")
        else:
            print(f"{r['batch']:>5}  {r['paged_tokens_per_s']:>11.2f}")
    print(json.dumps({"load": {"bytes": nbytes, "read_s": read_s, "load_s": load_s}, "decode": rows}))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
