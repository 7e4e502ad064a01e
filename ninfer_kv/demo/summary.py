"""The demo's result: one object, rendered as a readable table or as one JSON object.

JSON keys (every key is present; ``null`` where it does not apply):

* throughput: ``requests``, ``generated_tokens``, ``tokens_per_s`` (generated tokens over the
  serving wall time, compilation included), ``serve_seconds``, ``compile_seconds``,
  ``tokens_per_s_excl_compile``, ``rounds``, ``prefill_tokens``;
* correctness: ``dense_match``, ``dense_tolerance``, ``dense`` (``tokens_match``, ``tie_flips``,
  ``max_abs_logit_diff``, ``tolerance``, ``checked_tokens``, ``mismatched_requests``);
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
* setup: ``profile``, ``impl`` (resolved), ``backend``, ``device``, ``model``, ``plan`` (the
  ``ninfer-kv plan`` JSON of the store's plan), ``seed``, ``workload_seed``.
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
        d = self.data
        lines = [
            f"ninfer-kv demo: {d['requests']} requests on model {d['model']['name']} "
            f"({d['model']['layers']} layers, {d['model']['kv_heads']} KV heads x {d['model']['head_dim']}), "
            f"profile {d['profile']}, backend {d['backend']}, impl {d['impl']}, device {d['device']}",
            "",
        ]
        dense = d["dense"]
        verdict = "match" if d["dense_match"] else "MISMATCH"
        pairs = [
            ("generated tokens", f"{d['generated_tokens']:,} in {d['serve_seconds']:.2f} s = {d['tokens_per_s']:.1f} tokens/s "
             f"({d['compile_seconds']:.1f} s of compilation included; {d['tokens_per_s_excl_compile']:.1f} tokens/s "
             f"without it; {d['rounds']} rounds)"),
            ("prefix hits", f"{d['prefix_hits']} forks of a retained system prompt ({d['prefix_tokens_reused']:,} prompt "
             f"tokens not recomputed); {d['prefix_jobs']} prefix prefills"),
            ("host tier", (f"offloaded {d['offloaded_pages']} pages, restored {d['restored_pages']} pages; "
                           f"peak host {format_bytes(d['peak_host_bytes'])}") if d["host_tier"] else "not available"),
            ("evictions", f"{d['evictions']['offloads']} offloaded, {d['evictions']['releases']} released "
             f"({d['evictions']['host_full']} because the host arena was full)"),
            ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(d["finish_reasons"].items()))
             + (f" ({d['bounded_completions']} bounded by the lease)" if d["bounded_completions"] else "")),
            ("admission", f"peak {d['peak_active']} active lanes; the queue head waited in {d['admission_waits']} rounds"
             + (f"; {d['lease_pages_granted']} pages granted at round boundaries" if d["kv_lease_growth"] else "")),
            ("dense check", "skipped (--no-dense-check)" if dense is None else
             f"{verdict}: {dense['checked_tokens']:,} tokens, greedy tokens "
             + ("equal" if dense["tokens_match"] else f"equal but {dense['tie_flips']} tie(s) within the tolerance")
             + f", max |logit diff| {dense['max_abs_logit_diff']:.2e} (tolerance {dense['tolerance']:.0e})"),
            ("leaks", f"{d['leaked_pages']} pages, {d['leaked_host_extents']} host extents"),
        ]
        if d.get("mtp"):
            m = d["mtp"]
            pairs.insert(
                1,
                ("MTP", f"{m['rounds']} lane-rounds, {m['drafts_accepted']} of {m['drafts_verified']} drafts accepted "
                 f"({m['acceptance_rate']:.1%}), {m['tokens_per_round']:.2f} tokens per round"),
            )
        width = max(len(k) for k, _ in pairs)
        lines += [f"  {k.ljust(width)}  {v}" for k, v in pairs]
        plan = d["plan"]
        rows = [
            [pool, f"{d['pool_pages'][pool]:,}", f"{d['peak_pages'][pool]:,}", format_bytes(p["page_bytes"]), format_bytes(p["bytes"])]
            for pool, p in plan["pools"].items()
        ]
        lines += [
            "",
            f"pools (S = {plan['max_context']}, C = {plan['max_concurrency']}, M = {plan['main_pages']} Main pages)",
            render_table(["pool", "pages", "peak pages", "page bytes", "bytes"], rows, right=(1, 2, 3, 4)),
            "",
            "step functions",
            render_table(
                ["step", "calls", "buckets", "compiles"],
                [
                    [name, d["units"].get(name, 0), ",".join(str(b) for b in d["buckets"].get(name, [])) or "-", n]
                    for name, n in d["compiles"].items()
                ],
                right=(1, 3),
            ),
        ]
        return "\n".join(lines)
