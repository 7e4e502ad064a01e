"""The demo's result: one object, rendered as a readable table or as one JSON object.

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
* compilation: ``compiles`` (per step function: backend compilations during this run),
  ``buckets`` (per step function: the batch buckets it ran in), ``units`` (calls per step);
* ``mtp`` (backend mtp: ``draft_window``, ``head_calibration_agreement``, ``rounds``,
  ``drafts_verified``, ``drafts_accepted``, ``acceptance_rate``, ``tokens_per_round``);
* ``tokens_digest``: sha256 hex of every request's generated tokens in request order (the UTF-8
  bytes of the compact JSON ``[[request id, [token, ...]], ...]``): equal for equal outputs, so a
  mesh run and a one-device run with the same ``--seed`` can be compared;
* setup: ``profile``, ``impl`` (resolved), ``backend``, ``device``, ``mesh`` (``{"data": D, "model": T}``
  with ``--mesh``, else ``null``), ``model``, ``plan`` (the ``ninfer-kv plan`` JSON of the store's
  plan; with a mesh the mesh plan, its ``per_device`` part one device's), ``seed``, ``workload_seed``.
  With a mesh the counters and ``pool_pages`` are summed over the data shards.
"""

from __future__ import annotations

import dataclasses

from ..cli import format_bytes, render_table

__all__ = ["DemoResult"]


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
            f"KV cache format {d['profile']}, speculative decoding {d['backend']}, kernels {d['impl']} on {d['device']}",
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
            "step functions (compiled once per batch size)",
            render_table(
                ["step", "calls", "batch sizes", "compiles"],
                [
                    [name, d["units"].get(name, 0), ",".join(str(b) for b in d["buckets"].get(name, [])) or "-", n]
                    for name, n in d["compiles"].items()
                ],
                right=(1, 3),
            ),
        ]
        return "\n".join(lines)
