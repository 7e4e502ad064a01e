"""Shared pieces of the server tests: a tiny text checkpoint, ``ninfer-kv serve`` as a subprocess,
clients bound to it, and readers of its error bodies and ``/metrics``.

The checkpoint is the engine tests' tiny float32 Llama (vocabulary 256, 2 layers, hidden 128, no
end-of-sequence token, so a greedy completion always runs to ``max_tokens``) with a character-level
tokenizer: a BPE without merges whose 256 tokens are 256 distinct characters.  Every token id
decodes to exactly one character and text encodes back to the same ids, so a completion's text is
its token ids (:func:`encode`, :func:`decode`), and a text of ``k`` characters is ``k`` tokens.

The server runs as users start it, ``python -m ninfer_kv serve --model DIR --port PORT ...``, on
127.0.0.1 only, with its output in a log file: :class:`ServerProcess` starts it on a free port,
waits for ``GET /health`` to answer 200, and fails with the log when the process dies.
:func:`running_server` wraps that for module fixtures: on teardown it sends SIGTERM, requires exit
status 0, and fails loudly (with the log) when the server died during the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

httpx = pytest.importorskip("httpx")  # raw HTTP for what the openai client does not send

_MODEL_TESTS = str(Path(__file__).resolve().parents[1] / "models")
if _MODEL_TESTS not in sys.path:  # hf_fixtures lives beside the model tests (a rootdir module there)
    sys.path.insert(0, _MODEL_TESTS)

from hf_fixtures import FAMILY_CONFIGS, random_tensors, write_checkpoint  # noqa: E402

HOST = "127.0.0.1"
VOCAB = 256
CHARS = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(0x100 + i) for i in range(VOCAB - 96)]
"""Token id -> its one character (printable ASCII, newline, then Latin Extended letters)."""

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The checkpoint's chat template (``tokenizer_config.json``)."""

HF_CONFIG = dict(FAMILY_CONFIGS["llama"], vocab_size=VOCAB, torch_dtype="float32")

STARTUP_TIMEOUT = 180.0
"""Seconds a server may take to answer ``/health`` (a few normally; generous for a loaded CI host)."""

REQUEST_TIMEOUT = 60.0
"""Seconds any one HTTP request of the tests may take."""


def encode(text: str) -> list[int]:
    """The token ids of ``text`` under the character-level tokenizer."""
    return [CHARS.index(c) for c in text]


def decode(ids) -> str:
    """The text of token ids."""
    return "".join(CHARS[int(i)] for i in ids)


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """``messages`` rendered as :data:`TEMPLATE` renders them."""
    text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def write_text_checkpoint(directory: Path) -> Path:
    """Write the tiny checkpoint, its tokenizer and chat template into ``directory``."""
    tokenizers = pytest.importorskip("tokenizers", reason="text prompts need the 'hf' extra")
    write_checkpoint(directory, HF_CONFIG, random_tensors(HF_CONFIG, seed=1, dtype="F32"))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = tokenizers.decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerDied(AssertionError):
    """The server process exited when it should be serving."""


class ServerProcess:
    """``python -m ninfer_kv serve --model DIR --host 127.0.0.1 --port PORT *flags`` as a subprocess.

    Args:
      model: the ``--model`` argument, passed as given.
      flags: further command-line arguments.
      log_dir: where the process's output (stdout and stderr together) is written.
    """

    def __init__(self, model: str | os.PathLike, *flags: str, log_dir: Path | None = None):
        self.model = str(model)
        self.flags = [str(f) for f in flags]
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="ninfer-serve-"))
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    # -- addresses ------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    @property
    def api_url(self) -> str:
        """The OpenAI base URL, ``http://127.0.0.1:PORT/v1``."""
        return self.url + "/v1"

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self, timeout: float = STARTUP_TIMEOUT) -> "ServerProcess":
        """Start on a free port and wait until ``/health`` answers 200 (a port taken between the
        check and the bind is retried on another)."""
        for attempt in range(3):
            self._spawn()
            try:
                self.wait_ready(timeout)
                return self
            except ServerDied:
                if attempt < 2 and "address already in use" in self.log().lower():
                    continue
                raise
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        self.port = free_port()
        self.log_path = self.log_dir / f"serve-{self.port}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("NINFER_KV_API_KEY", None)  # the server's default --api-key: only the flags given here count
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # several servers may share one GPU
        cmd = [sys.executable, "-m", "ninfer_kv", "serve", "--model", self.model, "--host", HOST,
               "--port", str(self.port), *self.flags]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        """Poll ``GET /health`` until it answers 200; :class:`ServerDied` if the process exits."""
        deadline = time.monotonic() + timeout
        last = None
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                self.check_alive("while starting")
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code == 200:
                        return
                    last = f"/health answered {r.status_code}: {r.text[:200]}"
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                time.sleep(0.1)
        self.kill()
        raise AssertionError(f"the server did not answer GET /health with 200 within {timeout:.0f} s "
                             f"(last: {last})\n{self.describe()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self, when: str = "") -> None:
        """Raise :class:`ServerDied` (with the log) if the process has exited."""
        if not self.alive():
            raise ServerDied(f"the server exited {when} with status {self.proc.returncode}\n{self.describe()}")

    def terminate(self, timeout: float) -> int:
        """SIGTERM, then wait up to ``timeout`` seconds; returns the exit status (SIGKILL and raise
        if it is still running then)."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout:.0f} s of SIGTERM\n{self.describe()}")

    def kill(self) -> None:
        """SIGKILL the process if it still runs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    # -- output -----------------------------------------------------------------------------------------------
    def log(self) -> str:
        """Everything the process has written so far."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def describe(self, tail: int = 8000) -> str:
        text = self.log()
        if len(text) > tail:
            text = "...\n" + text[-tail:]
        cmd = " ".join(self.proc.args) if self.proc is not None else "(not started)"
        return f"command: {cmd}\n--- server output ---\n{text}\n--- end of server output ---"


@contextlib.contextmanager
def running_server(model, *flags: str, log_dir: Path | None = None,
                   shutdown_timeout: float = 60.0) -> Iterator[ServerProcess]:
    """A started :class:`ServerProcess`, terminated on exit.

    On exit the server must still run (it died otherwise: fail with its log), and SIGTERM must end
    it with status 0 within ``shutdown_timeout`` seconds."""
    server = ServerProcess(model, *flags, log_dir=log_dir)
    server.start()
    try:
        yield server
    finally:
        died = not server.alive()
        rc = server.proc.returncode if died else server.terminate(shutdown_timeout)
    if died:
        pytest.fail(f"the server died during the tests (exit status {rc})\n{server.describe()}", pytrace=False)
    if rc != 0:
        pytest.fail(f"the server exited with status {rc} after SIGTERM (0 expected)\n{server.describe()}",
                    pytrace=False)


# -- clients ---------------------------------------------------------------------------------------------------
def http_client(server: ServerProcess, *, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT):
    """A raw ``httpx`` client on the server (the bearer ``api_key`` when given)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=timeout, trust_env=False)


def openai_client(server: ServerProcess, *, api_key: str = "unused", timeout: float = REQUEST_TIMEOUT):
    """The official synchronous client on the server's ``/v1`` (no retries: an error is seen at once)."""
    import openai

    return openai.OpenAI(base_url=server.api_url, api_key=api_key, max_retries=0, timeout=timeout,
                         http_client=httpx.Client(timeout=timeout, trust_env=False))


def async_openai_client(server: ServerProcess, *, api_key: str = "unused", timeout: float = REQUEST_TIMEOUT):
    """The official asyncio client on the server's ``/v1`` (no retries; room for 128 connections)."""
    import openai

    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    return openai.AsyncOpenAI(base_url=server.api_url, api_key=api_key, max_retries=0, timeout=timeout,
                              http_client=httpx.AsyncClient(timeout=timeout, trust_env=False, limits=limits))


def assert_error(response, status: int, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> dict:
    """``response`` has ``status`` and an OpenAI error body ``{"error": {"message", "type", "param",
    "code"}}`` (with the given ``type``, ``param`` and ``code`` when they are given); returns the error."""
    where = f"{response.request.method} {response.request.url.path}"
    assert response.status_code == status, (f"{where}: status {response.status_code}, {status} expected: "
                                            f"{response.text[:500]}")
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{where}: the {status} body is not JSON: {response.text[:500]!r}") from None
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"{where}: not an OpenAI error body: {body}"
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, f"{where}: error fields missing: {err}"
    assert isinstance(err["message"], str) and err["message"], f"{where}: empty error message: {err}"
    if type is not None:
        assert err["type"] == type, f"{where}: error type {err['type']!r}, {type!r} expected: {err}"
    if param is not None:
        assert err["param"] == param, f"{where}: error param {err['param']!r}, {param!r} expected: {err}"
    if code is not None:
        assert err["code"] == code, f"{where}: error code {err['code']!r}, {code!r} expected: {err}"
    return err


# -- /metrics ----------------------------------------------------------------------------------------------------
class Metrics:
    """One scrape of ``/metrics`` (Prometheus text, parsed by ``prometheus_client``'s parser)."""

    def __init__(self, text: str):
        from prometheus_client.parser import text_string_to_metric_families

        self.text = text
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict, float]] = []
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.samples.append((s.name, dict(s.labels), float(s.value)))

    def names(self) -> set[str]:
        """Every sample name (``..._total``, ``..._bucket``, ``..._count`` included)."""
        return {name for name, _, _ in self.samples}

    def find(self, name: str, **labels) -> list[tuple[dict, float]]:
        """The samples called ``name`` whose labels include ``labels``."""
        return [(lab, v) for n, lab, v in self.samples
                if n == name and all(lab.get(k) == str(w) for k, w in labels.items())]

    def value(self, name: str, **labels) -> float:
        """The one sample called ``name`` with ``labels`` (an AssertionError when not exactly one)."""
        found = self.find(name, **labels)
        assert len(found) == 1, f"{len(found)} samples {name}{labels or ''} in /metrics:\n{self.text}"
        return found[0][1]

    def get(self, name: str, default: float = 0.0, **labels) -> float:
        """The sum of the samples called ``name`` with ``labels``, ``default`` when there are none
        (a labelled counter appears once its label value is first used)."""
        found = self.find(name, **labels)
        return sum(v for _, v in found) if found else default


def scrape(client) -> Metrics:
    """``GET /metrics`` with a raw client; it must answer 200 with Prometheus text."""
    r = client.get("/metrics")
    assert r.status_code == 200, f"/metrics answered {r.status_code}: {r.text[:500]}"
    return Metrics(r.text)


def wait_idle(client, timeout: float = 20.0) -> Metrics:
    """Scrape ``/metrics`` until no request runs or waits; returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(client)
        if m.value("ninfer_kv_requests_running") == 0 and m.value("ninfer_kv_requests_waiting") == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still running or waiting {timeout:.0f} s later:\n{m.text}")
        time.sleep(0.05)


def wait_until(condition, timeout: float, failure: str) -> None:
    """Poll ``condition()`` until it is true; an AssertionError saying ``failure`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{failure} (waited {timeout:.2f} s)")
        time.sleep(0.02)
