"""bench/bench_ragged_traffic.py: its byte counts on rounds small enough to count by hand."""

import json

import pytest

PAGE_HEAD = 64 * 2 * 128 * 2  # bf16: 64 tokens x (K + V) x 128 x 2 bytes per (page, KV head)
TOKEN_HEAD = 2 * 128 * 2  # bf16 K + V per (token, KV head)
H = 8  # KV heads



def _bytes(bench, call, config=None, rpa=(), geo=None):
    geo = geo or bench.Geometry(max_model_len=256)
    config = config or bench.PagedAttentionConfig()
    rnd = bench.Round("t", "test", (call,))
    return bench.measure(geo, config, rnd, list(rpa), "TPU v6")["bytes"]


def test_geometry_bytes_come_from_the_layout(bench):
    assert bench.Geometry().page_head_bytes == PAGE_HEAD and bench.Geometry().token_head_bytes == TOKEN_HEAD
    k8v4 = bench.Geometry(profile=bench.KVProfile.K8V4)
    assert k8v4.token_head_bytes == 128 + 2 + 64 + 8  # fp8 K codes + bf16 row scale + e2m1 V nibbles + u8 scales


def test_ideal_and_native_counts_by_hand(bench):
    # row 0: one decode at position 129 with 130 keys; row 1: 20 tokens at [110, 130) with 130 keys.
    call = bench.Call(positions=(129, 110), lengths=(1, 20), kv_lens=(130, 130))
    b = _bytes(bench, call)
    # Triton's query blocks: the decode (hi 130: 3 pages); chunk blocks of 128 query rows (32 tokens at
    # D 128, group 4), never past next_pow2(N = 21) = 32: one block [110, 130) -> hi 130 (3 pages).
    assert b["ideal (triton blocks)"] == (3 + 3) * H * PAGE_HEAD
    # Mosaic's: 64 tokens at group 4, but never past next_pow2(N = 21) = 32: one chunk block
    # [110, 130) -> hi 130 (3 pages), plus the decode's 3.
    assert b["ideal (mosaic blocks)"] == (3 + 3) * H * PAGE_HEAD
    assert b["row floor"] == (3 + 3) * H * PAGE_HEAD
    assert b["triton rows"] == (130 + 130) * H * TOKEN_HEAD  # masked loads stop at hi
    assert b["triton pages"] == b["ideal (triton blocks)"]
    assert b["mosaic"] == b["ideal (mosaic blocks)"]
    # The generic form: one query per token, each reading keys up to its own position.
    assert b["generic rows"] == (130 + sum(p + 1 for p in range(110, 130))) * H * TOKEN_HEAD
    assert b["generic pages"] == (3 + 18 * 2 + 2 * 3) * H * PAGE_HEAD  # positions 110..127: 2 pages, 128, 129: 3
    assert b["append"] == 21 * H * TOKEN_HEAD
    # Whole-page append: the decode's page and the chunk's pages 1 and 2 ([110, 128), [128, 130)), read + written.
    assert b["append (mosaic)"] == 2 * 3 * H * PAGE_HEAD
    # The append's page blocks do not depend on the attention's block_q; Mosaic's chunk count does.
    b4 = _bytes(bench, call, bench.PagedAttentionConfig(block_q=4))
    assert b4["append (mosaic)"] == b["append (mosaic)"]
    # block_q 4: the decode (3 pages), chunk blocks hi 114, 118, 122, 126 (2 pages each) and 130 (3 pages).
    assert b4["mosaic"] == b4["ideal (mosaic blocks)"] == (3 + 4 * 2 + 3) * H * PAGE_HEAD
    assert b4["triton pages"] == b4["ideal (triton blocks)"] == b4["mosaic"]
    assert b4["triton rows"] == (130 + 114 + 118 + 122 + 126 + 130) * H * TOKEN_HEAD


def test_mosaic_chunk_uses_64_token_blocks_by_default(bench):
    # A 128-token chunk at [0, 128) with 128 keys, GQA 4.  Mosaic: 256 query rows = 64 tokens per block,
    # 2 blocks (hi 64: 1 page; hi 128: 2 pages).  Triton (D 128): 128 query rows = 32 tokens, 4 blocks
    # (hi 32, 64: 1 page each; hi 96, 128: 2 pages each).
    call = bench.Call(positions=(0,), lengths=(128,), kv_lens=(128,))
    geo, config = bench.Geometry(max_model_len=256), bench.PagedAttentionConfig()
    assert bench.native_block_q(geo, config, call, "mosaic") == 64
    assert bench.native_block_q(geo, config, call, "triton") == 32
    chunk = {k: bench.native_classes(geo, config, call, k)[1] for k in bench.NATIVE}
    assert int((chunk["mosaic"].rows >= 0).sum()) == 2 and chunk["mosaic"].block_q == 64
    assert int((chunk["triton"].rows >= 0).sum()) == 4 and chunk["triton"].block_q == 32
    b = _bytes(bench, call)
    assert b["mosaic"] == b["ideal (mosaic blocks)"] == (1 + 2) * H * PAGE_HEAD
    assert b["triton pages"] == b["ideal (triton blocks)"] == (2 * 1 + 2 * 2) * H * PAGE_HEAD
    # config.block_q overrides both kernels' chunk blocks (what --block-q sets).
    b16 = _bytes(bench, call, bench.PagedAttentionConfig(block_q=16))
    assert b16["mosaic"] == b16["ideal (mosaic blocks)"] == b16["ideal (triton blocks)"] == (4 * 1 + 4 * 2) * H * PAGE_HEAD


def test_rpa_replay_by_hand(bench):
    call = bench.Call(positions=(129, 110), lengths=(1, 20), kv_lens=(130, 130))
    b = _bytes(bench, call, rpa=[bench.RpaSetting("rpa", 2, 4)])
    # 21 tokens in 6 query blocks of 4.  Block 0 holds the decode and the chunk's first 3 tokens, the
    # other 5 blocks only chunk tokens.  Each (block, sequence) walks the sequence's whole kv_len (130
    # keys) in kv blocks of 2 pages: 2 kv blocks, 4 page DMAs (the 4th page past kv_len is fetched too).
    assert b["rpa"] == (2 + 5) * 4 * H * PAGE_HEAD


@pytest.mark.parametrize("block_k,k_splits", [(64, None), (128, None), (64, 3), (256, 5)])
def test_ours_equal_the_ideal_on_page_aligned_blocks(bench, block_k, k_splits):
    # Decodes at 256 keys, a chunk [64, 192) with 192 keys, block_q 64: every block ends on a page boundary.
    call = bench.Call(positions=(255, 255, 64), lengths=(1, 1, 128), kv_lens=(256, 256, 192))
    config = bench.PagedAttentionConfig(block_q=64, block_k=block_k, k_splits=k_splits)
    b = _bytes(bench, call, config)
    assert b["ideal (triton blocks)"] == b["ideal (mosaic blocks)"] == (4 + 4 + 2 + 3) * H * PAGE_HEAD
    # splits and wide steps add nothing
    assert b["triton rows"] == b["triton pages"] == b["mosaic"] == b["ideal (triton blocks)"]


def test_generic_form_is_much_larger_for_a_chunk(bench):
    call = bench.Call(positions=(0,), lengths=(256,), kv_lens=(256,))
    b = _bytes(bench, call)
    assert b["ideal (triton blocks)"] == 2 * (1 + 2 + 3 + 4) * H * PAGE_HEAD  # 8 blocks of 32: hi = 32, ..., 256
    assert b["ideal (mosaic blocks)"] == (1 + 2 + 3 + 4) * H * PAGE_HEAD  # 4 blocks of 64: hi = 64, ..., 256
    assert b["generic rows"] == 256 * 257 // 2 * H * TOKEN_HEAD
    assert b["generic rows"] > 10 * b["ideal (triton blocks)"]


def test_main_reports_and_checks(bench, capsys):
    assert bench.main(["--rounds", "b0", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    (res,) = rep["rounds"]
    b = res["bytes"]
    # b0: 8 decodes of 4096 keys (64 pages each) + the chunk [0, 1024): Triton's 32 blocks of 32
    # (hi = 32 (j + 1)), Mosaic's 16 blocks of 64 (hi = 64 (j + 1)).
    assert b["ideal (triton blocks)"] == (8 * 64 + 2 * sum(range(1, 17))) * H * PAGE_HEAD
    assert b["ideal (mosaic blocks)"] == (8 * 64 + sum(range(1, 17))) * H * PAGE_HEAD
    assert res["calls"][0]["block_q"] == {"triton": 32, "mosaic": 64}
    # Each of ours against its own ideal: Mosaic's ratio is 1, not its 0.83 to the Triton blocks' ideal.
    assert res["ideal_of"]["mosaic"] == "ideal (mosaic blocks)"
    assert res["ratio"]["mosaic"] == 1.0 and res["ratio"]["triton pages"] == 1.0
    assert res["ratio"]["ideal (mosaic blocks)"] == b["ideal (mosaic blocks)"] / b["ideal (triton blocks)"] < 1
    assert all(res["pass"].values())
    assert res["calls"][0]["rpa"]["jax rpa table"]["num_kv_pages_per_block"] == 128  # untuned default at 8K tables
    for k in ("mosaic", "triton rows", "jax rpa table"):
        assert res["ratio_rpa"]["jax rpa 16x32"][k] == b[k] / b["jax rpa 16x32"]
    assert bench.main(["--rounds", "b0", "--check"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out and out.strip().splitlines()[-1].endswith("yes")
    assert "ideal (mosaic blocks)" in out and "x rpa 16x32" in out and "16 x (q64 k64 s1)" in out
    # --block-q sets both kernels' chunk blocks.
    assert bench.main(["--rounds", "b0", "--block-q", "32", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["rounds"]
    assert res["calls"][0]["block_q"] == {"triton": 32, "mosaic": 32}
    assert res["bytes"]["mosaic"] == res["bytes"]["ideal (mosaic blocks)"] == res["bytes"]["ideal (triton blocks)"]
    assert bench.main(["--rounds", "b0", "--check", "--limit", "0.9"]) == 1  # the check can fail
    assert "FAIL" in capsys.readouterr().out
