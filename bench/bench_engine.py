"""The serving engine (``ninfer_kv.engine.LLM``) on three workloads, and vLLM on the same ones when
its CPU build is importable from another virtual environment.

One checkpoint (default: Qwen3-0.6B's ``config.json`` with random bf16 weights, written once to
``--cache-dir``, 1.2 GB; ``--checkpoint DIR`` serves another), token-id prompts, greedy decoding,
``ignore_eos`` so every request generates exactly ``--max-new-tokens`` tokens:

1. ``offline``: 64 prompts of 128-1024 tokens (uniform random lengths, fixed seed);
2. ``shared``: one 1000-token system prompt (not a multiple of the 64-token page) followed by 64
   different questions of 20-80 tokens;
3. ``chat``: 16 conversations of 4 turns; turn k+1's prompt is turn k's prompt, its output and a new
   user message of 20-60 tokens.  Each turn of every conversation is submitted together, turn by turn;
4. ``uniform``: 8 prompts of exactly ``--uniform-tokens`` (512) tokens, nothing shared (with
   ``--requests uniform=1``: one request, the batch-1 decode figure);
5. ``long``: 2 prompts of exactly ``--long-tokens`` (6000) tokens, nothing shared: long-context
   prefill and decode (``--max-model-len`` must hold them: 8192 for the default).

Every prompt starts with a different token (the questions and user messages too), so the only
prefixes two prompts share are the ones a workload is built with.

Measured per workload, by driving ``llm.engine`` (the ``EngineCore``) directly: every request is
added at ``t0``, then ``step()`` runs until all have finished, recording when each request first
holds a generated token (TTFT) and when it finishes.  Model steps are timed by wrapping
``llm.engine.model.prefill`` / ``.ragged`` / ``.decode`` (the wrapper blocks on the step's ``next_tokens``, which the
engine reads to the host right after the call anyway); the engine's host time is the wall time
minus the time inside those steps.  Cached prompt tokens (the sum of ``num_cached_tokens``) are
compared with the exact prefix each workload shares:

* ``shared``: 64 x 1000 when every request reports the system prompt as cached (a prefix computed
  once for all of them), or 63 x 1000 when the first request computes it itself;
* ``chat``: turn k+1 shares turn k's prompt + output with it; the last output token's K/V was never
  computed (no step ran on it), so the reusable part is one token less per request.

The jitted steps are compiled before timing (every batch bucket of prefill and decode, plus a short
generation that forks a cached prefix), and each workload runs ``--warm-runs`` times untimed first
(the ragged rounds' shapes, rows x tokens, depend on the workload); compiles that still happen
inside a timed workload are counted and printed.

vLLM (``--vllm-python PATH``: the python of a virtual environment where ``import vllm`` works): the
same prompts run through ``vllm.LLM(model=DIR, skip_tokenizer_init=True, kv_cache_memory_bytes=<our
pool's bytes>, ...)`` in a subprocess (``VLLM_CPU_OMP_THREADS_BIND=0-1``, tcmalloc preloaded), measured
the same way through ``llm.llm_engine`` (``add_request`` / ``step``); the chat turns are built from
vLLM's own outputs.  Its block size and prefix caching stay at vLLM's defaults (printed), so its cached
tokens are also compared with the shared prefixes rounded down to whole blocks.  Without it:
``vLLM: not installed, skipped``.

    PYTHONPATH=. python bench/bench_engine.py                                   # everything, defaults
    PYTHONPATH=. python bench/bench_engine.py --requests 0.125 --max-new-tokens 16   # a quick check
    PYTHONPATH=. python bench/bench_engine.py --requests offline=8,shared=16,chat=4 --workloads shared,chat
    PYTHONPATH=. python bench/bench_engine.py --vllm-python /path/to/vllm-venv/bin/python   # and vLLM
    PYTHONPATH=. python bench/bench_engine.py --workloads long --max-model-len 8192 --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_COUNTS = {"offline": 64, "shared": 64, "chat": 16, "uniform": 8, "long": 2}
WORKLOADS = ("offline", "shared", "chat", "uniform", "long")
PROMPT_WORKLOADS = ("offline", "shared", "uniform", "long")  # those given as prompts (chat: as messages)
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


def build_workloads(vocab: int, counts: dict, *, seed: int, system_tokens: int, turns: int,
                    uniform_tokens: int = 512, long_tokens: int = 6000) -> dict:
    """Each workload's prompts (:data:`PROMPT_WORKLOADS`) or messages (``chat``), from ``seed``."""
    out = {}
    t = _Tokens(vocab, seed)
    out["offline"] = {"prompts": [t.seq(t.length(128, 1024)) for _ in range(counts["offline"])]}
    t = _Tokens(vocab, seed + 1)
    system = t.seq(system_tokens)
    out["shared"] = {"prompts": [system + t.seq(t.length(20, 80)) for _ in range(counts["shared"])],
                     "system_tokens": system_tokens}
    t = _Tokens(vocab, seed + 2)
    out["chat"] = {"messages": [[t.seq(t.length(20, 60)) for _ in range(turns)] for _ in range(counts["chat"])]}
    t = _Tokens(vocab, seed + 3)
    out["uniform"] = {"prompts": [t.seq(uniform_tokens) for _ in range(counts["uniform"])]}
    t = _Tokens(vocab, seed + 4)
    out["long"] = {"prompts": [t.seq(long_tokens) for _ in range(counts["long"])]}
    return out


def run_workload(backend, name: str, wl: dict, max_new: int) -> dict:
    """Run one workload through ``backend``; returns its per-request records and the shared-prefix
    references: ``exact_each`` (each request's exact shared prefix) and ``alt_each`` (the variant named
    ``alt_name``), one entry per request in submission order."""
    if name in PROMPT_WORKLOADS:
        batch = backend.run_batch(name, wl["prompts"], max_new)
        n = len(wl["prompts"])
        if name != "shared":
            exact_each, alt_each, alt_name = [0] * n, [0] * n, None
        else:
            p = wl["system_tokens"]
            exact_each, alt_each = [p] * n, [0] + [p] * (n - 1)
            alt_name = f"{n - 1} x {p} (the first request computes it)"
        return {"batches": [batch], "exact_each": exact_each, "alt_each": alt_each, "alt_name": alt_name,
                "exact_name": f"{n} x {wl['system_tokens']}" if name == "shared" else "0 (nothing shared)"}
    convs = wl["messages"]
    history = [[] for _ in convs]
    batches, exact_each, alt_each = [], [], []
    for turn in range(len(convs[0])):
        prompts = [history[c] + convs[c][turn] for c in range(len(convs))]
        exact_each += [len(h) for h in history]
        alt_each += [max(len(h) - 1, 0) for h in history]
        batch = backend.run_batch(f"chat{turn}", prompts, max_new)
        batches.append(batch)
        history = [prompts[c] + batch["requests"][c]["output"] for c in range(len(convs))]
    return {"batches": batches, "exact_each": exact_each, "alt_each": alt_each,
            "exact_name": "previous prompt + output",
            "alt_name": "previous prompt + output less its last token (its K/V was never computed)"}


def summarize(result: dict, block: int | None = None) -> dict:
    """Throughput, TTFT, cached tokens and host time of a workload's batches.  With ``block``, the
    shared-prefix references are also given rounded down to whole blocks of that many tokens."""
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
        "cached": cached, "exact": sum(result["exact_each"]), "alt": sum(result["alt_each"]),
        "exact_name": result["exact_name"], "alt_name": result["alt_name"],
        "concurrency": max(b.get("concurrency", 0) for b in result["batches"]),
    }
    if block:
        s.update(block=block, exact_blocks=sum(n // block * block for n in result["exact_each"]),
                 alt_blocks=sum(n // block * block for n in result["alt_each"]))
    if all("step_s" in b for b in result["batches"]):
        step = sum(b["step_s"] for b in result["batches"])
        s.update(step_s=step, host_s=wall - step, host_share=(wall - step) / wall,
                 **{f"{k}_steps": sum(b[f"{k}_steps"] for b in result["batches"]) for k in STEP_KINDS},
                 **{f"{k}_step_s": sum(b[f"{k}_step_s"] for b in result["batches"]) for k in STEP_KINDS},
                 compiles=sum(b["compiles"] for b in result["batches"]),
                 compile_s=sum(b["compile_s"] for b in result["batches"]),
                 compiled=sorted({n for b in result["batches"] for n in b["compiled"]}),
                 prefix_jobs=sum(b["prefix_jobs"] for b in result["batches"]),
                 rounds=sum(b["rounds"] for b in result["batches"]))
    return s


def references(s: dict) -> list[tuple[str, int]]:
    """The shared-prefix references a summary's cached-token count is compared with, by name."""
    refs = [(f"the exact shared prefix ({s['exact_name']})", s["exact"])]
    if s["alt_name"]:
        refs.append((s["alt_name"], s["alt"]))
    if "block" in s:
        rounded = f"rounded down to whole {s['block']}-token blocks"
        refs.append((f"the exact shared prefix {rounded}", s["exact_blocks"]))
        if s["alt_name"]:
            refs.append((f"{s['alt_name']}, {rounded}", s["alt_blocks"]))
    return refs


def cached_verdict(s: dict) -> str:
    matches = [name for name, value in references(s) if value == s["cached"]]
    if matches:
        return "equal to " + "; and to ".join(matches)
    return f"NOT equal to the exact shared prefix (cached - exact = {s['cached'] - s['exact']:+,})"


# -- the vLLM side ---------------------------------------------------------------------------------------------


class VllmBackend:
    """``vllm.LLM`` over the same checkpoint, driven through ``llm.llm_engine`` (``add_request`` / ``step``).

    vLLM's own defaults are kept for everything the comparison is about (block size, prefix caching,
    chunked prefill, the batched-token budget); only the KV cache size is set, to our pool's bytes."""

    def __init__(self, spec: dict):
        from vllm import LLM, SamplingParams
        from vllm.inputs import tokens_input

        self.SamplingParams = SamplingParams
        self.tokens_input = tokens_input
        start = time.perf_counter()
        self.llm = LLM(model=spec["checkpoint"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                       max_num_seqs=spec["max_num_seqs"], kv_cache_memory_bytes=spec["kv_bytes"],
                       skip_tokenizer_init=True, seed=0)
        self.load_s = time.perf_counter() - start
        self.engine = self.llm.llm_engine
        start = time.perf_counter()
        self._warm_up()
        self.warm_s = time.perf_counter() - start

    def config(self) -> dict:
        """The settings vLLM resolved that the comparison depends on."""
        cfg = self.engine.vllm_config
        return {"block_size": cfg.cache_config.block_size,
                "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
                "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
                "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
                "max_num_seqs": cfg.scheduler_config.max_num_seqs,
                "kv_tokens": (cfg.cache_config.num_gpu_blocks or 0) * cfg.cache_config.block_size,
                "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
                "load_s": self.load_s, "warm_s": self.warm_s}

    def _params(self, max_new: int):
        """Greedy, exactly ``max_new`` tokens, token ids only (no tokenizer)."""
        return self.SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, detokenize=False)

    def _warm_up(self) -> None:
        """A short generation, then one that hits a cached prefix (as ours does before timing)."""
        base = list(range(1, 2 * PAGE + 11))
        self.run_batch("warm0", [base], 3)
        self.run_batch("warm1", [base + [7, 8, 9], base[:PAGE + 5] + [5]], 3)
        self.reset()

    def reset(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")

    def run_batch(self, tag: str, prompts: list, max_new: int) -> dict:
        params = self._params(max_new)
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        first, done = {}, {}
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts):
            self.engine.add_request(rid, self.tokens_input(p), params)
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
    import vllm

    spec = json.loads(Path(spec_path).read_text())
    backend = VllmBackend(spec)
    config = backend.config()
    results = {}
    print(f"vLLM: start-up {config['load_s']:.1f} s, warm-up {config['warm_s']:.1f} s", flush=True)
    for name in spec["workloads"]:
        backend.reset()
        print(f"vLLM: running {name} ...", flush=True)
        result = run_workload(backend, name, spec["data"][name], spec["max_new"])
        results[name] = s = summarize(result, block=config["block_size"])
        print(f"vLLM:   {s['requests']} requests in {s['wall_s']:.1f} s", flush=True)
    Path(out_path).write_text(json.dumps({"version": vllm.__version__, "config": config, "results": results}))


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def vllm_env() -> dict:
    """The subprocess's environment: 2 OpenMP compute threads on cores 0-1 (as ours), tcmalloc."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1")
    if TCMALLOC.exists() and "tcmalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(TCMALLOC), env.get("LD_PRELOAD", "")]))
    env.pop("JAX_PLATFORMS", None)
    return env


def vllm_importable(python: str | None) -> bool:
    if not python:
        return False
    try:
        return subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter
        return False


def run_worker(python: str, spec: Path, out: Path, log: Path) -> int:
    """Run the vLLM subprocess; its output goes to ``log``, and its own ``vLLM:`` lines to stdout too."""
    cmd = [python, str(Path(__file__).resolve()), "--vllm-worker", str(spec), str(out)]
    with open(log, "w") as f, subprocess.Popen(cmd, env=vllm_env(), stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            f.write(line)
            if line.startswith("vLLM: "):
                print(f"  {line}", end="", flush=True)
    return proc.returncode


def run_vllm(args, checkpoint: Path, data: dict, workloads: list[str], kv_bytes: int) -> dict | None:
    """vLLM's summaries, or ``None`` (and the line saying so) when it cannot be imported or fails."""
    python = args.vllm_python
    if not vllm_importable(python):
        print("vLLM: not installed, skipped")
        return None
    log = args.cache_dir / "vllm_worker.log"
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"checkpoint": str(checkpoint), "dtype": args.dtype, "kv_bytes": kv_bytes,
                                    "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                    "workloads": workloads, "data": data, "max_new": args.max_new_tokens}))
        print(f"vLLM: running the workloads in {python} (its log: {log}) ...", flush=True)
        start = time.perf_counter()
        code = run_worker(python, spec, out, log)
        if code != 0 or not out.exists():
            print(f"vLLM: the subprocess failed (exit {code}); no comparison. The end of its log:")
            print("".join(log.read_text().splitlines(keepends=True)[-30:]))
            return None
        theirs = json.loads(out.read_text())
    c = theirs["config"]
    print(f"vLLM {theirs['version']}: whole subprocess {time.perf_counter() - start:.1f} s (start-up with "
          f"its compiles {c['load_s']:.1f} s, warm-up {c['warm_s']:.1f} s); block size {c['block_size']}, "
          f"prefix caching {c['enable_prefix_caching']}, chunked prefill {c['enable_chunked_prefill']}, "
          f"max_num_batched_tokens {c['max_num_batched_tokens']}, max_num_seqs {c['max_num_seqs']}, "
          f"dtype {c['dtype']}, KV cache {c['kv_tokens']:,} tokens ({kv_bytes / 2**30:.2f} GiB)", flush=True)
    return theirs


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


STEP_KINDS = ("prefill", "ragged", "decode")
"""The model calls timed: rectangular prefill chunks, ragged rounds (decodes beside prompt tokens), decodes."""


class _StepTimer:
    """Wraps a model's ``prefill`` / ``ragged`` / ``decode``: seconds inside them, blocked on ``next_tokens``."""

    def __init__(self, model):
        import jax

        self._block = jax.block_until_ready
        self.reset()
        for kind in STEP_KINDS:
            if callable(getattr(model, kind, None)):
                setattr(model, kind, self._wrap(kind, getattr(model, kind)))

    def reset(self) -> None:
        self.seconds = {kind: 0.0 for kind in STEP_KINDS}
        self.calls = {kind: 0 for kind in STEP_KINDS}

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
                       max_num_seqs=args.max_num_seqs, kv_capacity=kv_capacity,
                       max_num_batched_tokens=args.max_num_batched_tokens)
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
        model, runner = eng.model, eng.runner
        for kind, t in (("decode", 1), ("prefill", eng.chunk)):
            for b in eng.buckets:
                zeros = np.zeros(b, np.int32)
                args = (np.zeros((b, t), np.int32), zeros, zeros.copy(), zeros.copy())
                state, work = take_step_work(eng.store, runner.state)
                if kind == "prefill" and hasattr(model, "steps") and hasattr(model, "params"):
                    # the work taken is empty (the decode calls applied everything): the state stays valid
                    model.steps.on_state(kind).lower(model.params, state, work, *args).compile()
                    continue
                runner.state, out = getattr(model, kind)(state, work, *args, None)
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
                "step_s": sum(t.seconds.values()),
                **{f"{kind}_step_s": t.seconds[kind] for kind in STEP_KINDS},
                **{f"{kind}_steps": t.calls[kind] for kind in STEP_KINDS},
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


def _time(x: float) -> str:
    return f"{x * 1e3:,.0f} ms" if x < 10 else f"{x:,.1f} s"


def _ratio(s: dict, v: dict, key: str) -> str:
    return f"{s[key] / v[key]:.2f}x" if v[key] else "n/a"


def _side_by_side_rows(s: dict, v: dict | None) -> list[list]:
    """The rows both engines have: ninfer_kv, vLLM (empty without it), ninfer_kv / vLLM."""
    def row(label, fmt, key=None):
        return [label, fmt(s), fmt(v) if v else "", _ratio(s, v, key) if v and key else ""]

    rows = [row("requests", lambda x: x["requests"]),
            row("prompt / output tokens", lambda x: f"{x['prompt_tokens']:,} / {x['output_tokens']:,}"),
            row("wall time", lambda x: f"{x['wall_s']:.2f} s", "wall_s"),
            row("requests/s", lambda x: f"{x['req_per_s']:.3f}", "req_per_s"),
            row("output tokens/s", lambda x: f"{x['out_tok_per_s']:.2f}", "out_tok_per_s"),
            row("TTFT p50", lambda x: _time(x["ttft_p50"]), "ttft_p50"),
            row("TTFT p99", lambda x: _time(x["ttft_p99"]), "ttft_p99"),
            row("latency p50", lambda x: _time(x["latency_p50"]), "latency_p50"),
            row("cached prompt tokens", lambda x: f"{x['cached']:,}"),
            row(f"exact shared prefix: {s['exact_name']}", lambda x: f"{x['exact']:,}")]
    if s["alt_name"]:
        rows.append(row(f"  ... {s['alt_name']}", lambda x: f"{x['alt']:,}"))
    if v and "block" in v:
        rows.append([f"  ... rounded down to vLLM's {v['block']}-token blocks", "", f"{v['exact_blocks']:,}", ""])
        if s["alt_name"]:
            rows.append([f"  ... {s['alt_name']}, rounded down", "", f"{v['alt_blocks']:,}", ""])
    return rows


def _engine_rows(s: dict) -> list[list]:
    """The rows only ours has: where its wall time goes."""
    return [["max requests running at once", s["concurrency"]],
            ["model step time (prefill + ragged + decode)",
             f"{s['step_s']:.2f} s ({' + '.join(str(s[f'{k}_steps']) for k in STEP_KINDS)} steps: "
             f"{' + '.join(format(s[f'{k}_step_s'], '.2f') for k in STEP_KINDS)} s)"],
            ["engine host time (wall - steps)", f"{s['host_s']:.3f} s = {100 * s['host_share']:.2f}% of wall"],
            ["engine rounds (step() calls), host per round",
             f"{s['rounds']}, {1e3 * s['host_s'] / s['rounds']:.2f} ms"],
            ["prefix jobs", s["prefix_jobs"]],
            ["compiles inside the timed run", f"{s['compiles']} ({s['compile_s']:.2f} s)"
             + (f": {', '.join(s['compiled'])}" if s["compiled"] else "")]]


def print_workload(name: str, s: dict, v: dict | None) -> None:
    """One workload's table: ours and vLLM's numbers side by side (with the ratios), then ours alone."""
    print(f"\n## {name}\n")
    if v:
        print(table(_side_by_side_rows(s, v), ["", "ninfer_kv", "vLLM", "ninfer_kv / vLLM"]))
        print("(ninfer_kv / vLLM above 1: higher for ninfer_kv; better for rates, worse for times)\n")
        print(table(_engine_rows(s), ["", "ninfer_kv"]))
    else:
        print(table([r[:2] for r in _side_by_side_rows(s, None)] + _engine_rows(s), ["", "ninfer_kv"]))
    print(f"\nninfer_kv: cached prompt tokens {s['cached']:,}: {cached_verdict(s)}")
    if v:
        print(f"vLLM: cached prompt tokens {v['cached']:,}: {cached_verdict(v)}")


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
    ap.add_argument("--uniform-tokens", type=int, default=512, help="prompt length of the uniform workload")
    ap.add_argument("--long-tokens", type=int, default=6000, help="prompt length of the long workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                    help="ninfer_kv's round budget (default: the engine's)")
    ap.add_argument("--warm-runs", type=int, default=1, metavar="N",
                    help="untimed runs of each workload before the timed one (they compile the ragged rounds' "
                         "shapes; default 1)")
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
                           turns=args.turns, uniform_tokens=args.uniform_tokens, long_tokens=args.long_tokens)
    longest = max([len(p) for w in PROMPT_WORKLOADS if w in workloads for p in data[w]["prompts"]] +
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

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import machine  # bench/machine.py (imports the FFI library: after JAX_PLATFORMS is set)

    print(f"machine: {machine.describe()}")
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
        for _ in range(args.warm_runs):
            backend.reset()
            run_workload(backend, name, data[name], args.max_new_tokens)
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
    gc.collect()  # free our KV pool and weights before vLLM allocates its own

    theirs = run_vllm(args, checkpoint, {w: data[w] for w in workloads}, workloads, kv_bytes)
    for name in workloads:
        print_workload(name, ours[name], theirs["results"][name] if theirs else None)

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
