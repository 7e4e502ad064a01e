"""Soak: many sequences through one KV store, with device content checks and invariant checks.

Drives the store the way an engine does — root activations, Forks and Moves from retained
checkpoints (with COW tails), vectorized decode rounds, MTP speculative settlement (the MTP pool
leads Main by the draft window), early and length finishes, retain / release, checkpoint eviction —
writing every token into the device planes through the *published* block tables.  Before a sequence
finishes, its committed content is read back from the device in every pool and compared with what
it wrote (and inherited); ``audit_invariants`` runs every few rounds; at the end everything is
released and the pools must be empty.

    PYTHONPATH=. python bench/soak.py [--sequences 10000] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, SpeculativeConfig, plan_kv_cache
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv.device import apply_work_jit
from ninfer_kv.store import KVStore
from ninfer_kv.schema.errors import PoolCapacityError
from ninfer_kv.device import allocate_state

P = 64
MAIN, MTP = PoolKind.MAIN, PoolKind.MTP
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@functools.partial(jax.jit, static_argnames=("page_axis",), donate_argnums=(0,))
def _write(planes, pages, cols, values, *, page_axis):
    out = {}
    for name, plane in planes.items():
        bits = _UINT[jnp.dtype(plane.dtype).itemsize]
        x = jax.lax.bitcast_convert_type(plane, bits)
        p = jnp.where(pages >= 0, pages, x.shape[page_axis])
        v = jax.lax.bitcast_convert_type(values.astype(plane.dtype), bits)
        x = x.at[:, p, :, cols, :].set(v[:, None, None, None], mode="drop")
        out[name] = jax.lax.bitcast_convert_type(x, plane.dtype)
    return out


class _Writer:
    """The caller's device state, and the token writes of one round per pool, translated through the
    device block tables after the round work was applied."""

    PAD = 512

    def __init__(self, store):
        self.store = store
        self.state = allocate_state(store)
        self.pending = {k: [] for k in store.pool_kinds}

    def sync(self):
        """Apply the store's round work (table rows, COW copies) to the state."""
        self.state = apply_work_jit(self.state, self.store.take_work())
        return self.state

    def add(self, kind, row, start, values):
        if len(values):
            self.pending[kind].append((row, start, np.asarray(values, np.float32)))

    def flush(self):
        state = self.sync()
        for kind, items in self.pending.items():
            if not items:
                continue
            t = np.asarray(state.tables[kind])
            pages, cols, vals = [], [], []
            for row, start, v in items:
                pos = start + np.arange(v.size)
                pages.append(t[row, pos // P])
                cols.append(pos % P)
                vals.append(v)
            pages, cols, vals = np.concatenate(pages), np.concatenate(cols), np.concatenate(vals)
            planes = self.state.planes[kind]
            for s in range(0, pages.size, self.PAD):
                n = min(self.PAD, pages.size - s)
                pg = np.full(self.PAD, -1, np.int32)
                cl = np.zeros(self.PAD, np.int32)
                vl = np.zeros(self.PAD, np.float32)
                pg[:n], cl[:n], vl[:n] = pages[s : s + n], cols[s : s + n], vals[s : s + n]
                planes = _write(planes, pg, cl, vl, page_axis=1)
            self.state = self.state.replace_planes(kind, planes)
            items.clear()


class _Seq:
    def __init__(self, handle, target, content, lead):
        self.h = handle
        self.target = target
        self.content = content  # PoolKind -> list of committed values
        self.lead = lead


def _values(rng, n):
    return rng.integers(1, 251, size=n).astype(np.float32).tolist()


def _content_ok(store, kind, handle, expect, planes_np) -> bool:
    n = len(expect)
    if n == 0:
        return True
    phys = store.address_space(handle, kind).physical_pages
    pos = np.arange(n)
    for x in planes_np.values():
        got = x[:, phys[pos // P], :, pos % P, :].astype(np.float32)  # (n, Lyr, H, X)
        if not np.all(got == np.asarray(expect, np.float32)[:, None, None, None]):
            return False
    return True


def run_soak(
    sequences: int = 10_000,
    *,
    seed: int = 0,
    concurrency: int = 8,
    max_context: int = 1024,
    pages: int = 72,
    check_every: int = 25,
    verify_every: int = 1,
) -> dict:
    """Run ``sequences`` sequences; returns counters. Raises on any failed check."""
    rng = np.random.default_rng(seed)
    model = ModelKVConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    spec = SpeculativeConfig(method="mtp", draft_window=4, mtp_layers=1)
    plan = plan_kv_cache(
        model, max_context=max_context, max_concurrency=concurrency, policy=ExplicitCapacity(pages * P), speculative=spec
    )
    store = KVStore(plan, requires_state_image=True)
    lead = spec.draft_window - 1
    writer = _Writer(store)
    live: list[_Seq] = []
    ckpts: list = []  # (handle, content)
    admitted: list[_Seq] = []
    stats = dict(sequences=0, rounds=0, forks=0, moves=0, capacity_refusals=0, retained=0, verified=0,
                 spec_rounds=0, checks=0, pages_mapped=0)
    t0 = time.perf_counter()
    while stats["sequences"] < sequences or live:
        # -- admissions ----------------------------------------------------------------------------
        while stats["sequences"] < sequences and len(live) < concurrency and rng.random() < 0.7:
            src = None
            if ckpts and rng.random() < 0.5:
                i = int(rng.integers(len(ckpts)))
                src, src_content = ckpts[i]
            base = len(src_content[MAIN]) if src is not None else 0
            prompt = base + int(rng.integers(0 if src is not None else 1, 200))
            budget = int(rng.integers(1, 300))
            if prompt + budget > max_context:
                budget = max_context - prompt
                if budget <= 0:
                    break
            release = src is not None and rng.random() < 0.3
            try:
                h = store.activate(prompt, budget, source=src, release_source=release)
            except PoolCapacityError:
                stats["capacity_refusals"] += 1
                if ckpts:
                    ck, _ = ckpts.pop(0)
                    store.release_checkpoint(ck)
                break
            stats["sequences"] += 1
            content = {k: list(src_content[k]) if src is not None else [] for k in store.pool_kinds}
            if src is not None:
                stats["moves" if release else "forks"] += 1
                if release:
                    ckpts.pop(i)
            seq = _Seq(h, prompt + budget, content, lead)
            row = store.row(h)
            # prefill the rest of the prompt in every pool
            for kind in store.pool_kinds:
                c = len(content[kind])
                stats["pages_mapped"] += store.map(h, prompt, pool=kind)
                vals = _values(rng, prompt - c)
                writer.add(kind, row, c, vals)
                content[kind].extend(vals)
            live.append(seq)
            admitted.append(seq)
        if not live:
            continue
        if admitted:
            writer.flush()
            for seq in admitted:
                for kind in store.pool_kinds:
                    store.commit(seq.h, len(seq.content[kind]), pool=kind)
            admitted.clear()
        # -- one decode (or speculative) round over every live lane ----------------------------------
        rows = np.array([store.row(s.h) for s in live])
        c = np.array([len(s.content[MAIN]) for s in live])
        target = np.array([s.target for s in live])
        spec_round = rng.random() < 0.3
        k = np.minimum(int(rng.integers(2, lead + 2)) if spec_round else 1, target - c)
        stats["pages_mapped"] += store.map(rows, c + k, pool=MAIN)
        cm = np.array([len(s.content[MTP]) for s in live])
        mtp_ent = np.array([store.address_space(s.h, MTP).entitlement_tokens for s in live])
        mtp_reach = np.minimum(cm + k + lead, mtp_ent)
        stats["pages_mapped"] += store.map(rows, mtp_reach, pool=MTP)
        main_vals, mtp_vals = [], []
        for r, ci, ki, cmi, reach in zip(rows, c, k, cm, mtp_reach):
            v = _values(rng, int(ki))
            w = _values(rng, int(reach - cmi))
            main_vals.append(v)
            mtp_vals.append(w)
            writer.add(MAIN, int(r), int(ci), v)
            writer.add(MTP, int(r), int(cmi), w)
        writer.flush()
        # the unit succeeded: settle each pool on its accepted frontier (MTP keeps its lead mapped)
        accepted = np.array([int(rng.integers(1, ki + 1)) if ki > 0 else 0 for ki in k])
        store.settle(rows, c + accepted, pool=MAIN)
        store.settle(rows, cm + accepted, np.minimum(cm + accepted + lead, mtp_ent), pool=MTP)
        for s, v, w, a in zip(live, main_vals, mtp_vals, accepted):
            s.content[MAIN].extend(v[:a])
            s.content[MTP].extend(w[:a])
        stats["rounds"] += 1
        stats["spec_rounds"] += int(spec_round)
        # -- finishes ----------------------------------------------------------------------------
        done = [s for s in live if len(s.content[MAIN]) >= s.target or rng.random() < 0.01]
        if done:
            state = writer.sync()
            planes_np = {kind: {n: np.asarray(x) for n, x in state.planes[kind].items()} for kind in store.pool_kinds}
            for s in done:
                live.remove(s)
                if stats["sequences"] % verify_every == 0:
                    for kind in store.pool_kinds:
                        if not _content_ok(store, kind, s.h, s.content[kind], planes_np[kind]):
                            raise AssertionError(f"content mismatch in pool {kind.value} for {s.h}")
                    stats["verified"] += 1
                if rng.random() < 0.35:
                    frontiers = {kind: len(s.content[kind]) for kind in store.pool_kinds}
                    ck = store.finish(s.h, retain=True, state_image=("state", s.h.id), frontiers=frontiers)
                    ckpts.append((ck, s.content))
                    stats["retained"] += 1
                    if len(ckpts) > 6:
                        old, _ = ckpts.pop(0)
                        store.release_checkpoint(old)
                else:
                    store.finish(s.h)
        if stats["rounds"] % check_every == 0:
            store.audit_invariants()
            stats["checks"] += 1
    for ck, _ in ckpts:
        store.release_checkpoint(ck)
    store.audit_invariants()
    store.require_synced(writer.state)
    for kind in store.pool_kinds:
        occ = store.occupancy(kind)
        if occ.allocated or occ.reserved or occ.logical_pages or occ.retained_checkpoints:
            raise AssertionError(f"pool {kind.value} leaked: {occ}")
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    s = run_soak(args.sequences, seed=args.seed)
    print(
        f"soak: {s['sequences']} sequences, {s['rounds']} rounds ({s['spec_rounds']} speculative), "
        f"{s['forks']} forks, {s['moves']} moves, {s['retained']} retained, {s['capacity_refusals']} capacity "
        f"refusals, {s['pages_mapped']} pages mapped, {s['verified']} contents verified, {s['checks']} invariant "
        f"checks, no leaks, {s['seconds']} s"
    )


if __name__ == "__main__":
    main()
