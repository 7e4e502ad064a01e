"""Workload generation for the serving demo: prompts that share system prompts, in bursts.

A workload is a list of :class:`Request` in arrival order.  Most requests start with one of a few
*system prompts* (a shared prefix of ``system_prompt_tokens`` tokens, deliberately not a multiple
of the page size so that a prefix checkpoint ends inside a page) followed by a private user suffix;
the rest have unique prompts.  Shared requests arrive in bursts per system prompt, cycling through
the prompts, so that a prefix checkpoint goes cold while the other prompts are served and is
reused later (which is what makes a memory-pressured run offload it and restore it).

Everything is a pure function of the :class:`WorkloadSpec` and the vocabulary size: the same spec
gives the same tokens on every platform.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..schema.geometry import PAGE_SIZE
from ..schema.integers import check_int

__all__ = ["WorkloadSpec", "Request", "make_workload", "check_workload_fits"]


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What to generate.

    Attributes:
      requests: number of requests (>= 1).
      max_new_tokens: the largest output budget; each request draws its budget uniformly from
        ``[ceil(max_new_tokens / 2), max_new_tokens]``.
      system_prompt_tokens: length of every system prompt (>= 1).
      system_prompts: number of distinct system prompts (>= 0; 0 makes every prompt unique).
      shared_fraction: fraction of requests that start with a system prompt, in ``[0, 1]``.
      suffix_tokens: ``(lo, hi)`` inclusive range of the user suffix length of a shared request
        (``lo >= 1``: a shared prompt always extends its system prompt).
      unique_prompt_tokens: ``(lo, hi)`` inclusive range of the prompt length of a unique request.
      burst: consecutive shared arrivals per system prompt before moving to the next one.
      seed: the random seed.
    """

    requests: int = 32
    max_new_tokens: int = 24
    system_prompt_tokens: int = 150
    system_prompts: int = 3
    shared_fraction: float = 0.75
    suffix_tokens: tuple[int, int] = (8, 64)
    unique_prompt_tokens: tuple[int, int] = (40, 200)
    burst: int = 4
    seed: int = 0

    def __post_init__(self):
        for name, minimum in (("requests", 1), ("max_new_tokens", 1), ("system_prompt_tokens", 1),
                              ("system_prompts", 0), ("burst", 1), ("seed", 0)):
            check_int(name, getattr(self, name), minimum)
        if not 0.0 <= float(self.shared_fraction) <= 1.0:
            raise ValueError(f"shared_fraction={self.shared_fraction!r} is invalid; it must lie in [0, 1]")
        for name, lo_min in (("suffix_tokens", 1), ("unique_prompt_tokens", 1)):
            rng = tuple(getattr(self, name))
            if len(rng) != 2 or check_int(f"{name}[0]", rng[0], lo_min) > check_int(f"{name}[1]", rng[1], lo_min):
                raise ValueError(f"{name}={rng!r} is invalid; it must be (lo, hi) with {lo_min} <= lo <= hi")
            object.__setattr__(self, name, (int(rng[0]), int(rng[1])))

    @property
    def longest_sequence(self) -> int:
        """Upper bound of ``prompt + budget`` over every request this spec can generate."""
        shared = self.system_prompt_tokens + self.suffix_tokens[1] if self.system_prompts else 0
        return max(shared, self.unique_prompt_tokens[1]) + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of the workload.

    Attributes:
      id: arrival index.
      prompt: int32 prompt tokens (read-only).
      max_new_tokens: output budget (>= 1).
      prefix_group: index of the system prompt the prompt starts with, or ``None``.
      prefix_tokens: length of that system prompt (0 when ``prefix_group`` is ``None``);
        ``prefix_tokens < len(prompt)``.
      stop_tokens: token ids that end the request when generated (the model's EOS ids).
    """

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    prefix_group: int | None = None
    prefix_tokens: int = 0
    stop_tokens: tuple[int, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def total_tokens(self) -> int:
        """``prompt + budget``: the most tokens this request's sequence can hold."""
        return self.prompt_tokens + self.max_new_tokens


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    # token 0 is left out so a padding row's token never looks like real input in a dump
    return rng.integers(1, vocab_size, size=n, dtype=np.int64).astype(np.int32)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int32)
    a.flags.writeable = False
    return a


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    """The requests of ``spec`` in arrival order (see the module docstring)."""
    if not isinstance(spec, WorkloadSpec):
        raise TypeError(f"spec must be a WorkloadSpec, got {type(spec).__name__}")
    check_int("vocab_size", vocab_size, 2)
    rng = np.random.default_rng([spec.seed, 0x5EED])
    systems = [_tokens(rng, spec.system_prompt_tokens, vocab_size) for _ in range(spec.system_prompts)]
    n_shared = int(round(spec.shared_fraction * spec.requests)) if systems else 0
    # arrival slots of the shared requests: spread evenly, unique requests fill the gaps
    shared_slots = set(np.linspace(0, spec.requests - 1, n_shared).round().astype(int).tolist()) if n_shared else set()
    while len(shared_slots) < n_shared:  # rounding collisions (tiny workloads)
        shared_slots.add(min(set(range(spec.requests)) - shared_slots))
    lo_budget = -(-spec.max_new_tokens // 2)
    out: list[Request] = []
    k = 0  # shared requests emitted so far
    for i in range(spec.requests):
        budget = int(rng.integers(lo_budget, spec.max_new_tokens + 1))
        if i in shared_slots:
            group = (k // spec.burst) % len(systems)
            k += 1
            suffix = _tokens(rng, int(rng.integers(spec.suffix_tokens[0], spec.suffix_tokens[1] + 1)), vocab_size)
            prompt = np.concatenate([systems[group], suffix])
            out.append(Request(i, _frozen(prompt), budget, group, spec.system_prompt_tokens))
        else:
            n = int(rng.integers(spec.unique_prompt_tokens[0], spec.unique_prompt_tokens[1] + 1))
            out.append(Request(i, _frozen(_tokens(rng, n, vocab_size)), budget))
    return out


def check_workload_fits(requests: Sequence[Request], max_context: int, logical_pages: int, lead: int = 0) -> None:
    """Raise ``ValueError`` unless every request fits one sequence: ``prompt + budget <= S`` and, with
    an MTP draft lead of ``lead`` tokens, ``prompt + budget + lead <= L * P``."""
    ceiling = logical_pages * PAGE_SIZE
    for r in requests:
        if r.total_tokens > max_context:
            raise ValueError(
                f"request {r.id} needs prompt {r.prompt_tokens} + budget {r.max_new_tokens} = {r.total_tokens} tokens "
                f"but --max-context is {max_context} (allowed: >= {max(q.total_tokens for q in requests)} for this workload)"
            )
        if r.total_tokens + lead > ceiling:
            raise ValueError(
                f"request {r.id}: {r.total_tokens} tokens plus the MTP draft lead of {lead} exceed the logical capacity "
                f"L*P = {ceiling} tokens; raise --max-context"
            )
