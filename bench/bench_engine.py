"""The serving engine (``ninfer_kv.engine.LLM``) on three workloads, and vLLM on the same ones when
its CPU build is importable from another virtual environment.

One checkpoint (default: Qwen3-0.6B's ``config.json`` with random bf16 weights, written once to
``--cache-dir``, 1.2 GB; ``--checkpoint DIR`` serves another), token-id prompts, greedy decoding,
``ignore_eos`` so every request generates exactly ``--max-new-tokens`` tokens:

1. ``offline``: 64 prompts of 128-1024 tokens (uniform random lengths, fixed seed);
2. ``shared``: one 1000-token system prompt (not a multiple of the 64-token page) followed by 64
   different questions of 20-80 tokens;
3. ``chat``: 16 conversations of 4 turns; turn k+1's prompt is turn k's prompt, its output and a new
   user message of 20-60 tokens.  Each turn of every conversation is submitted together, turn by turn.

Every prompt starts with a different token (the questions and user messages too), so the only
prefixes two prompts share are the ones a workload is built with.

Measured per workload, by driving ``llm.engine`` (the ``EngineCore``) directly: every request is
added at ``t0``, then ``step()`` runs until all have finished, recording when each request first
holds a generated token (TTFT) and when it finishes.  Model steps are timed by wrapping
``llm.engine.model.prefill`` / ``.decode`` (the wrapper blocks on the step's ``next_tokens``, which the
engine reads to the host right after the call anyway); the engine's host time is the wall time
minus the time inside those steps.  Cached prompt tokens (the sum of ``num_cached_tokens``) are
compared with the exact prefix each workload shares:

* ``shared``: 64 x 1000 when every request reports the system prompt as cached (a prefix computed
  once for all of them), or 63 x 1000 when the first request computes it itself;
* ``chat``: turn k+1 shares turn k's prompt + output with it; the last output token's K/V was never
  computed (no step ran on it), so the reusable part is one token less per request.

The jitted steps are compiled before timing (every batch bucket of prefill and decode, plus a short
generation that forks a cached prefix); compiles that still happen inside a timed workload are
counted and printed.

vLLM (``--vllm-python PATH``: the python of a virtual environment where ``import vllm`` works): the
same prompts run through ``vllm.LLM(model=DIR, ...)`` in a subprocess (``VLLM_CPU_OMP_THREADS_BIND``
0-1), measured the same way through ``llm.llm_engine`` (``add_request`` / ``step``); the chat turns
are built from vLLM's own outputs.  Without it: ``vLLM: not installed, skipped``.

    PYTHONPATH=. python bench/bench_engine.py                                   # everything, defaults
    PYTHONPATH=. python bench/bench_engine.py --requests 0.125 --max-new-tokens 16   # a quick check
    PYTHONPATH=. python bench/bench_engine.py --requests offline=8,shared=16,chat=4 --workloads shared,chat
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_COUNTS = {"offline": 64, "shared": 64, "chat": 16}
WORKLOADS = ("offline", "shared", "chat")
PAGE = 64


# -- workloads (plain token ids; shared with the vLLM subprocess) ---------------------------------------------


class _Tokens:
    """Random token ids whose sequences all start with different tokens."""

    def __init__(self, vocab: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self._firsts = iter(self.rng.permutation(vocab).tolist())

    def seq(self, n: int) -> list[int]:
        return [next(self._firsts)] + self.rng.integers(0, self.vocab, n - 1).tolist()

    def length(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))


def build_workloads(vocab: int, counts: dict, *, seed: int, system_tokens: int, turns: int) -> dict:
    """Each workload's prompts (``offline``, ``shared``) or messages (``chat``), from ``seed``."""
    out = {}
    t = _Tokens(vocab, seed)
    out["offline"] = {"prompts": [t.seq(t.length(128, 1024)) for _ in range(counts["offline"])]}
    t = _Tokens(vocab, seed + 1)
    system = t.seq(system_tokens)
    out["shared"] = {"prompts": [system + t.seq(t.length(20, 80)) for _ in range(counts["shared"])],
                     "system_tokens": system_tokens}
    t = _Tokens(vocab, seed + 2)
    out["chat"] = {"messages": [[t.seq(t.length(20, 60)) for _ in range(turns)] for _ in range(counts["chat"])]}
    return out


def run_workload(backend, name: str, wl: dict, max_new: int) -> dict:
    """Run one workload through ``backend``; returns its per-request records and references."""
    if name in ("offline", "shared"):
        batch = backend.run_batch(name, wl["prompts"], max_new)
        n = len(wl["prompts"])
        if name == "offline":
            exact, alt, alt_name = 0, 0, None
        else:
            p = wl["system_tokens"]
            exact, alt, alt_name = n * p, (n - 1) * p, f"{n - 1} x {p} (the first request computes it)"
        return {"batches": [batch], "exact": exact, "alt": alt, "alt_name": alt_name,
                "exact_name": "0 (nothing shared)" if name == "offline" else f"{n} x {wl['system_tokens']}"}
    convs = wl["messages"]
    history = [[] for _ in convs]
    batches, exact, alt = [], 0, 0
    for turn in range(len(convs[0])):
        prompts = [history[c] + convs[c][turn] for c in range(len(convs))]
        if turn:
            exact += sum(len(h) for h in history)
            alt += sum(len(h) - 1 for h in history)
        batch = backend.run_batch(f"chat{turn}", prompts, max_new)
        batches.append(batch)
        history = [prompts[c] + batch["requests"][c]["output"] for c in range(len(convs))]
    return {"batches": batches, "exact": exact, "alt": alt, "exact_name": "previous prompt + output",
            "alt_name": "less its last output token (no K/V computed)"}


def summarize(result: dict) -> dict:
    """Throughput, TTFT, cached tokens and host time of a workload's batches."""
    reqs = [r for b in result["batches"] for r in b["requests"]]
    wall = sum(b["wall"] for b in result["batches"])
    ttft = np.array([r["ttft"] for r in reqs])
    out_tokens = sum(len(r["output"]) for r in reqs)
    cached = sum(r["cached"] for r in reqs)
    s = {
        "requests": len(reqs), "wall_s": wall, "req_per_s": len(reqs) / wall, "out_tok_per_s": out_tokens / wall,
        "output_tokens": out_tokens, "prompt_tokens": sum(r["prompt_len"] for r in reqs),
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
        "latency_p50": float(np.percentile([r["latency"] for r in reqs], 50)),
        "cached": cached, "exact": result["exact"], "alt": result["alt"],
        "exact_name": result["exact_name"], "alt_name": result["alt_name"],
        "concurrency": max(b.get("concurrency", 0) for b in result["batches"]),
    }
    if all("step_s" in b for b in result["batches"]):
        step = sum(b["step_s"] for b in result["batches"])
        s.update(step_s=step, host_s=wall - step, host_share=(wall - step) / wall,
                 prefill_steps=sum(b["prefill_steps"] for b in result["batches"]),
                 decode_steps=sum(b["decode_steps"] for b in result["batches"]),
                 prefill_step_s=sum(b["prefill_step_s"] for b in result["batches"]),
                 decode_step_s=sum(b["decode_step_s"] for b in result["batches"]),
                 compiles=sum(b["compiles"] for b in result["batches"]),
                 compile_s=sum(b["compile_s"] for b in result["batches"]),
                 compiled=sorted({n for b in result["batches"] for n in b["compiled"]}),
                 prefix_jobs=sum(b["prefix_jobs"] for b in result["batches"]),
                 rounds=sum(b["rounds"] for b in result["batches"]))
    return s


def cached_verdict(s: dict) -> str:
    if s["cached"] == s["exact"]:
        return f"equal to the exact shared prefix ({s['exact_name']})"
    if s["alt_name"] and s["cached"] == s["alt"]:
        return f"equal to {s['alt_name']}"
    return f"NOT equal (cached - exact = {s['cached'] - s['exact']:+d})"


# -- the vLLM side ---------------------------------------------------------------------------------------------


class VllmBackend:
    """``vllm.LLM`` over the same checkpoint, driven through ``llm.llm_engine``."""

    def __init__(self, spec: dict):
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        dtype = {"auto": "auto", "bfloat16": "bfloat16", "float32": "float32"}[spec["dtype"]]
        self.llm = LLM(model=spec["checkpoint"], dtype=dtype, max_model_len=spec["max_model_len"],
                       max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=True, skip_tokenizer_init=True,
                       seed=0)
        self.engine = self.llm.llm_engine
        warm = self.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
        self.llm.generate([{"prompt_token_ids": list(range(1, 300))}, {"prompt_token_ids": list(range(1, 200))}],
                          warm, use_tqdm=False)
        self.reset()

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def run_batch(self, tag: str, prompts: list, max_new: int) -> dict:
        params = self.SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False)
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        first, done = {}, {}
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts):
            self.engine.add_request(rid, {"prompt_token_ids": p}, params)
        while self.engine.has_unfinished_requests():
            outs = self.engine.step()
            now = time.perf_counter() - t0
            for o in outs:
                if o.request_id not in first and o.outputs and len(o.outputs[0].token_ids) > 0:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id] = (now, o)
        wall = time.perf_counter() - t0
        reqs = []
        for rid, p in zip(ids, prompts):
            t_done, o = done[rid]
            reqs.append({"ttft": first.get(rid, t_done), "latency": t_done, "output": list(o.outputs[0].token_ids),
                         "cached": int(o.num_cached_tokens or 0), "prompt_len": len(p)})
        return {"wall": wall, "requests": reqs}


def vllm_worker(spec_path: str, out_path: str) -> None:
    """The subprocess: run every workload through vLLM, write the summaries as JSON."""
    spec = json.loads(Path(spec_path).read_text())
    backend = VllmBackend(spec)
    results = {}
    for name in spec["workloads"]:
        backend.reset()
        results[name] = summarize(run_workload(backend, name, spec["data"][name], spec["max_new"]))
    import vllm

    Path(out_path).write_text(json.dumps({"version": vllm.__version__, "results": results}))


def run_vllm(args, checkpoint: Path, data: dict, workloads: list[str], kv_bytes: int) -> dict | None:
    """vLLM's summaries, or ``None`` (and the line saying so) when it cannot be imported."""
    python = args.vllm_python
    try:
        importable = bool(python) and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        importable = False
    if not importable:
        print("vLLM: not installed, skipped")
        return None
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_bytes / 2**30))))
    env.pop("JAX_PLATFORMS", None)
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"checkpoint": str(checkpoint), "dtype": args.dtype,
                                    "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                    "workloads": workloads, "data": data, "max_new": args.max_new_tokens}))
        print(f"vLLM: running the workloads in {python} ...", flush=True)
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--vllm-worker", str(spec), str(out)], env=env)
        if proc.returncode != 0 or not out.exists():
            print(f"vLLM: the subprocess failed (exit {proc.returncode}); no comparison")
            return None
        return json.loads(out.read_text())


# -- the ninfer_kv side ----------------------------------------------------------------------------------------


class _CompileWatch:
    """Backend compiles (count, seconds) while active."""

    def __init__(self):
        import jax

        self.active, self.count, self.seconds, self.names = False, 0, 0.0, []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.seconds += duration
            self.names.append(str(kwargs.get("fun_name", "?")))


class _StepTimer:
    """Wraps a model's ``prefill`` / ``decode``: seconds inside them, blocked on ``next_tokens``."""

    def __init__(self, model):
        import jax

        self._block = jax.block_until_ready
        self.reset()
        for kind in ("prefill", "decode"):
            setattr(model, kind, self._wrap(kind, getattr(model, kind)))

    def reset(self) -> None:
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.calls = {"prefill": 0, "decode": 0}

    def _wrap(self, kind: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            state, out = fn(*args, **kwargs)
            self._block(out.next_tokens)
            self.seconds[kind] += time.perf_counter() - start
            self.calls[kind] += 1
            return state, out

        return timed


class NinferBackend:
    """``ninfer_kv.engine.LLM`` over the checkpoint, driven through ``llm.engine``."""

    def __init__(self, args, checkpoint: Path, kv_capacity):
        from ninfer_kv.engine import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        start = time.perf_counter()
        self.llm = LLM(str(checkpoint), dtype=args.dtype, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, kv_capacity=kv_capacity)
        self.load_s = time.perf_counter() - start
        self.engine = self.llm.engine
        self.compiles = _CompileWatch()
        start = time.perf_counter()
        self._warm_up()
        self.warm_s = time.perf_counter() - start
        self.timer = _StepTimer(self.engine.model)
        self._ids = 0

    def _warm_up(self) -> None:
        """Compile decode and prefill for every batch bucket, then run a short generation that forks a
        cached prefix (the work programs).  Decode runs on padding rows (``valid == 0``: nothing read or
        written); prefill of the package's decoder is compiled ahead of time (``lower().compile()``
        fills the same cache a call would, without computing a batch of padding chunks)."""
        import jax
        from ninfer_kv.device import take_step_work

        eng = self.engine
        model = eng.model
        for kind, t in (("decode", 1), ("prefill", eng.chunk)):
            for b in eng.buckets:
                zeros = np.zeros(b, np.int32)
                args = (np.zeros((b, t), np.int32), zeros, zeros.copy(), zeros.copy())
                state, work = take_step_work(eng.store, eng.state)
                if kind == "prefill" and hasattr(model, "steps") and hasattr(model, "params"):
                    # the work taken is empty (the decode calls applied everything): eng.state stays valid
                    model.steps.on_state(kind).lower(model.params, state, work, *args).compile()
                    continue
                eng.state, out = getattr(model, kind)(state, work, *args, None)
                jax.block_until_ready(out.next_tokens)
        params = self.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        base = list(range(1, 2 * PAGE + 11))
        self.llm.generate([base], params)
        self.llm.generate([base + [7, 8, 9], base[:PAGE + 5] + [5]], params)
        self.reset()

    def reset(self) -> None:
        self.llm.clear_cache()

    def run_batch(self, tag: str, prompts: list, max_new: int) -> dict:
        eng = self.engine
        params = self.SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        ids = []
        for _ in prompts:
            ids.append(f"{tag}-{self._ids}")
            self._ids += 1
        first, done = {}, {}
        stats0 = dict(vars(eng.stats))
        self.timer.reset()
        self.compiles.active, self.compiles.count, self.compiles.seconds, self.compiles.names = True, 0, 0.0, []
        concurrency = 0
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts):
            eng.add_request(rid, p, params)
        while eng.has_unfinished():
            outs = eng.step()
            now = time.perf_counter() - t0
            for o in outs:
                if o.request_id not in first and o.outputs[0].token_ids:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id] = (now, o)
            concurrency = max(concurrency, eng.num_running)
        wall = time.perf_counter() - t0
        self.compiles.active = False
        reqs = []
        for rid, p in zip(ids, prompts):
            t_done, o = done[rid]
            if o.error is not None:
                raise RuntimeError(f"request {rid} failed: {o.error}")
            reqs.append({"ttft": first.get(rid, t_done), "latency": t_done, "output": list(o.outputs[0].token_ids),
                         "cached": int(o.num_cached_tokens), "prompt_len": len(p)})
        t = self.timer
        return {"wall": wall, "requests": reqs, "concurrency": concurrency,
                "step_s": t.seconds["prefill"] + t.seconds["decode"],
                "prefill_step_s": t.seconds["prefill"], "decode_step_s": t.seconds["decode"],
                "prefill_steps": t.calls["prefill"], "decode_steps": t.calls["decode"],
                "compiles": self.compiles.count, "compile_s": self.compiles.seconds,
                "compiled": sorted(set(self.compiles.names)),
                "prefix_jobs": eng.stats.prefix_jobs - stats0["prefix_jobs"],
                "rounds": eng.stats.rounds - stats0["rounds"]}


# -- output ------------------------------------------------------------------------------------------------------


def table(rows: list[list], headers: list[str]) -> str:
    try:
        from tabulate import tabulate
    except ImportError:
        cells = [[str(c) for c in r] for r in [headers] + rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{model}, {os.cpu_count()} cores ({platform.machine()}), load average {load}"


def print_workload(name: str, s: dict, v: dict | None) -> None:
    def ms(x):
        return f"{x * 1e3:,.0f} ms" if x < 10 else f"{x:,.1f} s"

    rows = [["requests", s["requests"], v["requests"] if v else ""],
            ["max requests running at once", s["concurrency"], ""],
            ["prompt / output tokens", f"{s['prompt_tokens']:,} / {s['output_tokens']:,}",
             f"{v['prompt_tokens']:,} / {v['output_tokens']:,}" if v else ""],
            ["wall time", f"{s['wall_s']:.2f} s", f"{v['wall_s']:.2f} s" if v else ""],
            ["requests/s", f"{s['req_per_s']:.3f}", f"{v['req_per_s']:.3f}" if v else ""],
            ["output tokens/s", f"{s['out_tok_per_s']:.2f}", f"{v['out_tok_per_s']:.2f}" if v else ""],
            ["TTFT p50", ms(s["ttft_p50"]), ms(v["ttft_p50"]) if v else ""],
            ["TTFT p99", ms(s["ttft_p99"]), ms(v["ttft_p99"]) if v else ""],
            ["latency p50", ms(s["latency_p50"]), ms(v["latency_p50"]) if v else ""],
            ["cached prompt tokens", f"{s['cached']:,}", f"{v['cached']:,}" if v else ""],
            [f"exact shared prefix: {s['exact_name']}", f"{s['exact']:,}", ""]]
    if s["alt_name"]:
        rows.append([f"  ... {s['alt_name']}", f"{s['alt']:,}", ""])
    rows += [["model step time (prefill + decode)",
              f"{s['step_s']:.2f} s ({s['prefill_steps']} + {s['decode_steps']} steps: "
              f"{s['prefill_step_s']:.2f} + {s['decode_step_s']:.2f} s)", ""],
             ["engine host time (wall - steps)", f"{s['host_s']:.3f} s = {100 * s['host_share']:.2f}% of wall", ""],
             ["engine rounds (step() calls), host per round",
              f"{s['rounds']}, {1e3 * s['host_s'] / s['rounds']:.2f} ms", ""],
             ["prefix jobs", s["prefix_jobs"], ""],
             ["compiles inside the timed run", f"{s['compiles']} ({s['compile_s']:.2f} s)"
              + (f": {', '.join(s['compiled'])}" if s["compiled"] else ""), ""]]
    headers = ["", "ninfer_kv", "vLLM"] if v else ["", "ninfer_kv"]
    if v:
        def ratio(key):
            return f"{s[key] / v[key]:.2f}x" if v[key] else "n/a"

        rows += [["ninfer_kv / vLLM: requests/s", ratio("req_per_s"), ""],
                 ["ninfer_kv / vLLM: output tokens/s", ratio("out_tok_per_s"), ""],
                 ["ninfer_kv / vLLM: TTFT p50, p99", f"{ratio('ttft_p50')}, {ratio('ttft_p99')}", ""],
                 ["cached tokens ninfer_kv - vLLM", f"{s['cached'] - v['cached']:+,}", ""]]
    else:
        rows = [r[:2] for r in rows]
    print(f"\n## {name}\n")
    print(table(rows, headers))
    print(f"\ncached prompt tokens {s['cached']:,}: {cached_verdict(s)}")


# -- main ----------------------------------------------------------------------------------------------------------


def parse_counts(text: str | None) -> dict:
    counts = dict(DEFAULT_COUNTS)
    if not text:
        return counts
    if "=" not in text:
        scale = float(text)
        return {k: max(1, round(v * scale)) for k, v in counts.items()}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in counts:
            raise SystemExit(f"--requests: unknown workload {key!r}; workloads: {', '.join(WORKLOADS)}")
        counts[key.strip()] = int(value)
    return counts


def ensure_checkpoint(args) -> Path:
    if args.checkpoint is not None:
        return args.checkpoint
    directory = args.cache_dir / "qwen3-0.6b-random"
    if not (directory / "config.json").exists():
        from ninfer_kv.models.hf import save_random_checkpoint
        from ninfer_kv.models.hf.published_configs import QWEN3_0_6B

        print(f"writing a Qwen3-0.6B-shaped checkpoint with random bf16 weights to {directory} (once) ...", flush=True)
        tmp = directory.with_name(directory.name + ".partial")
        save_random_checkpoint(tmp, QWEN3_0_6B, seed=0)
        tmp.rename(directory)
    return directory


def kv_tokens_needed(data: dict, workloads: list[str], max_new: int) -> int:
    """Main pool tokens that hold every request of the largest workload at once (whole pages, plus one
    page per request for a copied tail), rounded up to 4096."""
    need = 0
    for name in workloads:
        if name == "chat":
            msgs = data["chat"]["messages"]
            lens = [sum(len(m) for m in conv) + (len(conv) - 1) * max_new for conv in msgs]
        else:
            lens = [len(p) for p in data[name]["prompts"]]
        need = max(need, sum((-(-(n + max_new) // PAGE) + 1) * PAGE for n in lens))
    return -(-need // 4096) * 4096


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="a checkpoint directory (default: the random Qwen3-0.6B in --cache-dir)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/ninfer_kv_bench"))
    ap.add_argument("--workloads", default="offline,shared,chat")
    ap.add_argument("--requests", default=None,
                    help="a scale factor of the default counts (offline 64, shared 64, chat 16 conversations), "
                         "or per workload: offline=8,shared=8,chat=4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-capacity", default=None,
                    help="Main pool tokens, or 'auto' (default: enough for every request of a workload at once)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of a virtual environment with vLLM's CPU build")
    ap.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="profile each workload with cProfile and print its N functions of most own time "
                         "(the profiler slows the host side: host times are then not comparable)")
    args = ap.parse_args()

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown {w!r}; workloads: {', '.join(WORKLOADS)}")
    counts = parse_counts(args.requests)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    checkpoint = ensure_checkpoint(args)
    config = json.loads((checkpoint / "config.json").read_text())
    data = build_workloads(int(config["vocab_size"]), counts, seed=args.seed, system_tokens=args.system_tokens,
                           turns=args.turns)
    longest = max([len(p) for w in ("offline", "shared") if w in workloads for p in data[w]["prompts"]] +
                  [sum(len(m) for m in c) + (len(c) - 1) * args.max_new_tokens
                   for c in data["chat"]["messages"] if "chat" in workloads] + [1])
    if args.max_model_len < longest + args.max_new_tokens:
        raise SystemExit(f"--max-model-len {args.max_model_len} is too small: the longest prompt has {longest} tokens "
                         f"and {args.max_new_tokens} more are generated")
    if args.kv_capacity is None:
        kv_capacity = kv_tokens_needed(data, workloads, args.max_new_tokens)
    elif args.kv_capacity == "auto":
        kv_capacity = "auto"
    else:
        kv_capacity = int(args.kv_capacity)

    print(f"machine: {machine()}")
    print(f"JAX {jax.__version__} ({jax.devices()[0].platform}), numpy {np.__version__}, "
          f"Python {platform.python_version()}")
    print(f"checkpoint: {checkpoint} ({config.get('architectures', ['?'])[0]}, "
          f"{config.get('num_hidden_layers')} layers, "
          f"vocab {config['vocab_size']})")
    print(f"workloads: {', '.join(f'{w} {counts[w]}' for w in workloads)}"
          f"{' conversations' if 'chat' in workloads else ''}"
          f"; max_new_tokens {args.max_new_tokens}, max_num_seqs {args.max_num_seqs}, "
          f"max_model_len {args.max_model_len}, kv_capacity {kv_capacity}, dtype {args.dtype}, greedy, ignore_eos")

    backend = NinferBackend(args, checkpoint, kv_capacity)
    plan = backend.llm.plan
    kv_bytes = int(plan.device_bytes)
    print(f"ninfer_kv: load {backend.load_s:.1f} s, warm-up (compiles) {backend.warm_s:.1f} s, "
          f"batch buckets {backend.engine.buckets}, prefill chunk {backend.engine.chunk}, "
          f"KV pool {plan.capacity_tokens:,} tokens ({kv_bytes / 2**30:.2f} GiB)", flush=True)
    ours = {}
    for name in workloads:
        backend.reset()
        print(f"running {name} ...", flush=True)
        if args.cprofile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            result = prof.runcall(run_workload, backend, name, data[name], args.max_new_tokens)
            print(f"cProfile of {name}, top {args.cprofile} by own time:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        else:
            result = run_workload(backend, name, data[name], args.max_new_tokens)
        ours[name] = summarize(result)
        s = ours[name]
        print(f"  {s['requests']} requests in {s['wall_s']:.1f} s, host {100 * s['host_share']:.2f}%", flush=True)
    del backend

    theirs = run_vllm(args, checkpoint, {w: data[w] for w in workloads}, workloads, kv_bytes)
    for name in workloads:
        print_workload(name, ours[name], theirs["results"][name] if theirs else None)
    if theirs:
        print(f"\nvLLM {theirs['version']}")

    print("\n## Goals\n")
    for name in [w for w in ("shared", "chat") if w in workloads]:
        s = ours[name]
        print(f"- {name}: cached {s['cached']:,} vs exact shared prefix {s['exact']:,}"
              + (f" / {s['alt']:,} ({s['alt_name']})" if s["alt_name"] else "") + f": {cached_verdict(s)}")
    for name in workloads:
        s = ours[name]
        mark = "met" if s["host_share"] <= 0.05 else "NOT met"
        print(f"- {name}: host time {100 * s['host_share']:.2f}% of wall at up to {s['concurrency']} requests "
              f"running at once (goal <= 5% at 64): {mark}")
    if args.json:
        args.json.write_text(json.dumps({"ninfer_kv": ours, "vllm": theirs}, indent=1))


if __name__ == "__main__":
    main()
