"""The demo's result: what a run measured (:func:`demo_result`), one object rendered as a readable
table or as one JSON object.

JSON keys (every key is present; ``null`` where it does not apply):

* throughput: ``requests``, ``generated_tokens``, ``tokens_per_s`` (generated tokens over the
  serving wall time, compilation included), ``serve_seconds``, ``compile_seconds``,
  ``tokens_per_s_excl_compile``, ``rounds``, ``prefill_tokens``;
* correctness: ``dense_match``, ``dense_tolerance``, ``dense`` (``tokens_match``, ``tie_flips``,
  ``max_abs_logprob_diff``, ``max_relative_diff``, ``logit_scale``, ``tolerance``, ``checked_tokens``,
  ``mismatched_requests``; ``ninfer-kv demo`` exits with status 3 when ``dense_match`` is false);
  ``null`` with ``--no-dense-check``;
* prefixes and memory: ``prefix_hits``, ``prefix_tokens_reused``, ``prefix_jobs``,
  ``offloaded_pages``, ``restored_pages`` (the store's Host transfer counters), ``evictions``
  (``offloads``, ``releases``, ``host_full``), ``host_tier``, ``peak_host_bytes``, ``peak_pages``
  (per pool: the most pages leased or reserved at once), ``pool_pages`` (per pool: capacity),
  ``leaked_pages`` (pages still leased or reserved once every checkpoint is released: 0),
  ``leaked_host_extents`` (0);
* scheduling: ``finish_reasons``, ``bounded_completions``, ``lease_pages_granted``,
  ``kv_lease_growth``, ``peak_active``, ``admission_waits``;
* compilation: ``compiles`` (per step function: XLA compilations during this run),
  ``buckets`` (per step function: the batch buckets it ran in; a ragged round's ``[rows, tokens]``
  buckets), ``units`` (calls per step);
* ``mtp`` (speculative mtp: ``draft_window``, ``head_calibration_agreement``, ``rounds``,
  ``drafts_verified``, ``drafts_accepted``, ``acceptance_rate``, ``tokens_per_round``);
* ``tokens_digest``: sha256 hex of every request's generated tokens in request order (the UTF-8
  bytes of the compact JSON ``[[request id, [token, ...]], ...]``): equal for equal outputs, so a
  mesh run and a one-device run with the same ``--seed`` can be compared;
* setup: ``profile``, ``impl`` (resolved), ``speculative``, ``device``, ``mesh`` (``{"data": D, "model": T}``
  with ``--mesh``, else ``null``), ``model``, ``plan`` (the ``ninfer-kv plan`` JSON of the store's
  plan; with a mesh the mesh plan, its ``per_device`` part one device's), ``seed``, ``workload_seed``.
  With a mesh the counters and ``pool_pages`` are summed over the data shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from ..cli import render_table
from ..schema.sizes import format_bytes

__all__ = ["DemoResult", "demo_result", "tokens_digest"]


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """Everything a demo run measured (see the module docstring for the JSON keys)."""

    data: dict
    records: tuple = dataclasses.field(default=(), repr=False, compare=False)  # RequestRecord per request

    def __getitem__(self, key):
        return self.data[key]

    def to_json(self) -> dict:
        return dict(self.data)

    def table(self) -> str:
        """The summary in plain words (the JSON keys hold the same numbers)."""
        d = self.data
        lines = [
            f"ninfer-kv demo: {d['requests']} requests on model {d['model']['name']} "
            f"({d['model']['layers']} layers, {d['model']['kv_heads']} KV heads x {d['model']['head_dim']}), "
            f"KV cache format {d['profile']}, speculative decoding {d['speculative']}, kernels {d['impl']} on {d['device']}",
            "",
        ]
        dense = d["dense"]
        ev = d["evictions"]
        reasons = {"length": "reached their token budget"}
        pairs = [
            ("speed", f"{d['generated_tokens']:,} tokens generated in {d['serve_seconds']:.2f} s = {d['tokens_per_s']:.1f} "
             f"tokens/s, of which {d['compile_seconds']:.1f} s was compiling ({d['tokens_per_s_excl_compile']:.1f} "
             f"tokens/s without it); {d['rounds']} scheduling steps"),
            ("shared prompts", f"{d['prefix_hits']} requests reused a cached prefix "
             f"({d['prefix_tokens_reused']:,} prompt tokens not recomputed); {d['prefix_jobs']} shared prefixes computed once"),
            ("host memory", (f"{d['offloaded_pages']} KV pages moved to host memory, {d['restored_pages']} moved back; "
                             f"at most {format_bytes(d['peak_host_bytes'])} held there") if d["host_tier"] else "not used"),
            ("memory pressure", f"{ev['offloads']} cached prompts moved to host memory, {ev['releases']} dropped"
             + (f" ({ev['host_full']} because host memory was full)" if ev["host_full"] else "")),
            ("finished", ", ".join(f"{v} {reasons.get(k, k)}" for k, v in sorted(d["finish_reasons"].items()))
             + (f" ({d['bounded_completions']} stopped early: the KV cache could not grow)"
                if d["bounded_completions"] else "")),
            ("batching", f"up to {d['peak_active']} requests decoded together; a waiting request could not start "
             f"in {d['admission_waits']} steps"
             + (f"; {d['lease_pages_granted']} KV pages granted as requests grew" if d["kv_lease_growth"] else "")),
            ("correctness", "not checked (--no-dense-check)" if dense is None else
             ("same tokens" if dense["tokens_match"] else f"{dense['tie_flips']} near-tie token(s) differ")
             + f" as an unpaged full-precision model over {dense['checked_tokens']:,} tokens; largest "
             f"log-probability difference {dense['max_abs_logprob_diff']:.2e} = {dense['max_relative_diff']:.2e} x the "
             f"logits' scale (allowed {dense['tolerance']:.0e} x scale): "
             + ("PASS" if d["dense_match"] else "FAIL (exit status 3)")),
            ("leaks", "none: every KV page and host buffer was returned" if not (d["leaked_pages"] or d["leaked_host_extents"])
             else f"{d['leaked_pages']} KV pages and {d['leaked_host_extents']} host buffers not returned"),
        ]
        if d.get("mtp"):
            m = d["mtp"]
            pairs.insert(
                1,
                ("draft tokens", f"{m['drafts_accepted']} of {m['drafts_verified']} drafted tokens accepted "
                 f"({m['acceptance_rate']:.1%}), {m['tokens_per_round']:.2f} tokens per model step"),
            )
        width = max(len(k) for k, _ in pairs)
        lines += [f"  {k.ljust(width)}  {v}" for k, v in pairs]
        plan = d["plan"]
        per_device = plan.get("per_device", plan)  # a mesh plan: page sizes of one device's pools
        rows = [
            [pool, f"{d['pool_pages'][pool]:,}", f"{d['peak_pages'][pool]:,}", format_bytes(p["page_bytes"]), format_bytes(p["bytes"])]
            for pool, p in per_device["pools"].items()
        ]
        lines += [
            "",
            f"KV memory (up to {per_device['max_context']:,} tokens per request, {plan['max_concurrency']} requests at once, "
            f"pages of {per_device['page_size']} tokens"
            + (f"; mesh data={d['mesh']['data']},model={d['mesh']['model']}: pages summed over the data shards, "
               "bytes of one device" if d.get("mesh") else "") + ")",
            render_table(["cache", "pages", "most in use", "bytes per page", "total"], rows, right=(1, 2, 3, 4)),
            "",
            "step functions (compiled once per shape: batch size, or rows x tokens of a ragged round)",
            render_table(
                ["step", "calls", "shapes", "compiles"],
                [
                    [name, d["units"].get(name, 0), ",".join(_shape(b) for b in d["buckets"].get(name, [])) or "-", n]
                    for name, n in d["compiles"].items()
                ],
                right=(1, 3),
            ),
        ]
        return "\n".join(lines)


def tokens_digest(records) -> str:
    """sha256 hex of every request's generated tokens in request order: the UTF-8 bytes of the
    compact JSON list ``[[request id, [token, ...]], ...]``."""
    doc = [[int(r.request.id), [int(t) for t in r.generated]] for r in sorted(records, key=lambda r: r.request.id)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def demo_result(config, plan, served, *, generated: int, serve_seconds: float, compile_seconds: float, dense,
                calibration: float | None, impl: str, device: str) -> DemoResult:
    """The :class:`DemoResult` of a run of ``config`` (a :class:`~ninfer_kv.demo.config.DemoConfig`)
    with ``plan``: what :func:`~ninfer_kv.demo.serve.serve` returned (``served``), ``generated``
    tokens in ``serve_seconds`` (``compile_seconds`` of them compiling), the dense check (``None``
    when skipped), the MTP head's calibration agreement, the resolved ``impl`` and the ``device``
    platform."""
    model = config.model_config
    records = served.records
    st = served.stats
    finish_reasons: dict[str, int] = {}
    for r in records:
        finish_reasons[r.finish_reason] = finish_reasons.get(r.finish_reason, 0) + 1
    data = {
        "requests": len(records),
        "generated_tokens": generated,
        "tokens_per_s": generated / serve_seconds if serve_seconds > 0 else 0.0,
        "serve_seconds": serve_seconds,
        "compile_seconds": compile_seconds,
        "tokens_per_s_excl_compile": generated / (serve_seconds - compile_seconds)
        if serve_seconds > compile_seconds
        else 0.0,
        "dense_match": bool(dense.match) if dense is not None else None,
        "dense_tolerance": dense.tolerance if dense is not None else None,
        "dense": dense.to_json() if dense is not None else None,
        "prefix_hits": served.cache["hits"],
        "prefix_tokens_reused": served.cache["hit_tokens"],
        "prefix_jobs": st.prefix_jobs,
        "offloaded_pages": served.offloaded_pages,
        "restored_pages": served.restored_pages,
        "evictions": {"offloads": served.cache["offloaded"], "releases": served.cache["released"],
                      "host_full": served.cache["host_full"]},
        "host_tier": served.host_tier,
        "peak_host_bytes": served.peak_host_bytes,
        "compiles": served.compiles,
        "buckets": served.buckets,
        "units": served.units,
        "peak_pages": served.peak_pages,
        "pool_pages": served.pool_pages,
        "leaked_pages": served.leaked_pages,
        "leaked_host_extents": served.leaked_extents,
        "finish_reasons": finish_reasons,
        "bounded_completions": st.bounded_completions,
        "lease_pages_granted": st.lease_pages_granted,
        "peak_active": served.peak_active,
        "admission_waits": st.admission_waits,
        "rounds": st.rounds,
        "prefill_tokens": st.prefill_tokens,
        "mtp": None,
        "profile": config.profile.value,
        "impl": impl,
        "speculative": config.speculative,
        "kv_lease_growth": config.kv_lease_growth,
        "device": device,
        "mesh": None if config.mesh is None else {"data": config.mesh.data, "model": config.mesh.model},
        "mesh_steps": served.mesh_steps,
        "tokens_digest": tokens_digest(records),
        "model": {
            "name": config.model,
            "layers": model.num_layers,
            "kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
            "d_model": model.d_model,
            "vocab_size": model.vocab_size,
        },
        "plan": plan.to_json(),
        "seed": config.seed,
        "workload_seed": config.workload.seed,
    }
    if config.speculative == "mtp":
        data["mtp"] = {
            "draft_window": config.draft_window,
            "head_calibration_agreement": calibration,
            "rounds": st.spec_rounds,
            "drafts_verified": st.drafts_verified,
            "drafts_accepted": st.drafts_accepted,
            "acceptance_rate": st.drafts_accepted / st.drafts_verified if st.drafts_verified else 0.0,
            "tokens_per_round": st.decode_tokens / st.spec_rounds if st.spec_rounds else 0.0,
        }
    return DemoResult(data, tuple(sorted(records, key=lambda r: r.request.id)))


def _shape(bucket) -> str:
    """A batch bucket, or a ragged round's ``(rows, tokens)`` as ``RxN``."""
    return "x".join(str(b) for b in bucket) if isinstance(bucket, (list, tuple)) else str(bucket)
