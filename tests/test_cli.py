"""The ``ninfer-kv`` command line: JSON and table output, one-line errors with exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ninfer_kv
from ninfer_kv import cli
from ninfer_kv.schema import sizes as units
from ninfer_kv.cli import main
from ninfer_kv.schema.sizes import parse_bytes
from ninfer_kv.schema.profiles import PROFILE_ALIASES, KVProfile

REALISTIC = (
    "plan --layers 16 --kv-heads 2 --head-dim 256 --profile k8v4 --max-context 32768 "
    "--max-concurrency 64 --free-bytes 40GiB --speculative mtp --draft-window 4"
).split()
SMALL = "plan --layers 2 --kv-heads 2 --head-dim 64 --profile bf16 --max-context 1000 --max-concurrency 8".split()


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, argv):
    code, out, err = run(capsys, argv + ["--json"])
    assert code == 0 and err == ""
    assert out.endswith("\n") and out.count("\n") == 1
    return json.loads(out)


def assert_usage_error(capsys, argv, *needles):
    code, out, err = run(capsys, argv)
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err and err.startswith("ninfer-kv")
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# -- layout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "profile, k, v",
    [("bf16", 512, 512), ("int8-g64", 264, 264), ("fp8-e4m3fn-row256", 258, 258), ("nvfp4-g16", 144, 144), ("k8v4", 258, 144)],
)
def test_layout_json_d256(capsys, profile, k, v):
    js = run_json(capsys, ["layout", "--profile", profile, "--head-dim", "256"])
    assert set(js) == {"profile", "head_dim", "planes", "k_bytes", "v_bytes", "token_head_bytes"}
    assert (js["profile"], js["head_dim"], js["k_bytes"], js["v_bytes"], js["token_head_bytes"]) == (profile, 256, k, v, k + v)
    assert sum(p["bytes"] for p in js["planes"]) == k + v
    for plane in js["planes"]:
        assert set(plane) == {"name", "dtype", "extent", "group", "bytes"}


def test_layout_k8v4_planes(capsys):
    js = run_json(capsys, ["layout", "--profile", "k8v4", "--head-dim", "256"])
    assert [(p["name"], p["dtype"], p["extent"], p["bytes"]) for p in js["planes"]] == [
        ("k", "float8_e4m3fn", 256, 256),
        ("k_scale", "bfloat16", 1, 2),
        ("v", "uint8", 128, 128),
        ("v_scale", "uint8", 16, 16),
    ]


def test_layout_pool_view(capsys):
    argv = "layout --profile k8v4 --head-dim 256 --layers 16 --kv-heads 2 --order head-major --pages 3".split()
    js = run_json(capsys, argv)
    pool = js["pool"]
    assert pool["page_bytes"] == 402 * 2 * 16 * 64 == 823296
    assert pool["order"] == "head-major" and pool["pages"] == 3
    assert {p["name"]: p["shape"] for p in pool["planes"]}["v"] == [16, 2, 3, 64, 128]
    assert pool["bytes"] == 3 * 823296
    code, out, _ = run(capsys, argv)
    assert code == 0 and "(16, 2, 3, 64, 128)" in out and "823,296" in out


def test_layout_table(capsys):
    code, out, err = run(capsys, ["layout", "--profile", "int8-g64", "--head-dim", "256"])
    assert code == 0 and err == ""
    assert "k_scale" in out and "v_scale" in out and "bfloat16" in out
    assert "K 264 B + V 264 B = 528 B" in out


# -- plan -----------------------------------------------------------------------------------------
def test_plan_json_realistic(capsys):
    js = run_json(capsys, REALISTIC)
    for key in ("page_size", "logical_pages", "m_min", "m_max", "main_pages", "capacity_tokens", "pools", "curve", "device_bytes"):
        assert key in js
    assert (js["page_size"], js["logical_pages"], js["m_min"], js["m_max"]) == (64, 512, 512, 32768)
    assert js["main_pages"] == 32768 and js["capacity_tokens"] == 32768 * 64
    assert set(js["pools"]) == {"main", "mtp"}
    for pool in js["pools"].values():
        assert set(pool) >= {"profile", "order", "layers", "kv_heads", "head_dim", "physical_pages", "page_bytes", "bytes", "table_bytes"}
    assert js["pools"]["main"]["page_bytes"] == 823296
    assert js["pools"]["mtp"]["physical_pages"] == 32768 + 64
    assert js["curve"] == {"b_min": 451428352, "b_step": 874752}
    assert js["device_bytes"] == 28667428864


def test_plan_table_realistic(capsys):
    code, out, err = run(capsys, REALISTIC)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert any(line.startswith("main ") and "k8v4" in line and "page-major" in line for line in lines)
    assert any(line.startswith("mtp ") and "32,832" in line for line in lines)
    assert "B_min" in out and "451,428,352" in out and "B_step" in out and "874,752" in out
    assert "2,097,152 tokens" in out and "32,768 pages" in out
    assert "25.12 GiB" in out  # Main pool bytes in human units


def test_plan_json_matches_library(capsys):
    from ninfer_kv.planning import ExplicitCapacity, ModelKVConfig, SpeculativeConfig, plan_kv_cache

    argv = SMALL + ["--kv-capacity", "3000", "--fixed-bytes", "1MiB", "--speculative", "dflash", "--draft-full-layers", "1",
                    "--draft-kv-heads", "1", "--draft-head-dim", "96"]
    js = run_json(capsys, argv)
    plan = plan_kv_cache(
        ModelKVConfig(2, 2, 64, "bf16"),
        max_context=1000,
        max_concurrency=8,
        policy=ExplicitCapacity(3000),
        speculative=SpeculativeConfig("dflash", draft_full_layers=1, draft_kv_heads=1, draft_head_dim=96),
        fixed_bytes=2**20,
    )
    expect = plan.to_json()
    assert {k: js[k] for k in expect} == expect
    assert js["main_pages"] == 47
    assert js["pools"]["draft_full"]["order"] == "head-major" and js["pools"]["draft_full"]["head_dim"] == 96
    assert js["policy"] == {"kind": "explicit", "kv_capacity": 3000}


def test_plan_automatic_with_headroom(capsys):
    js = run_json(capsys, SMALL + ["--free-bytes", "1e7", "--headroom-bytes", "512KiB"])
    b_min, b_step = js["curve"]["b_min"], js["curve"]["b_step"]
    assert js["main_pages"] == min(js["m_max"], js["m_min"] + (10**7 - 2**19 - b_min) // b_step)
    assert js["policy"] == {"kind": "automatic", "free_bytes": 10**7, "headroom_bytes": 2**19}


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_plan_dflash_pools(capsys, backend):
    js = run_json(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", backend])
    assert set(js["pools"]) == {"main"}
    js = run_json(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", backend, "--draft-full-layers", "2"])
    assert set(js["pools"]) == {"main", "draft_full"}
    assert js["pools"]["draft_full"]["profile"] == "bf16"
    code, out, _ = run(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", backend, "--draft-full-layers", "2"])
    assert code == 0 and "draft_full" in out and "head-major" in out


def test_plan_mtp_layers(capsys):
    js = run_json(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", "mtp", "--draft-window", "130", "--mtp-layers", "3"])
    assert js["pools"]["mtp"]["layers"] == 3
    assert js["pools"]["mtp"]["physical_pages"] == js["main_pages"] + 3 * 8


# -- bad values -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needles",
    [
        ([a if a != "bf16" else "fp16" for a in SMALL] + ["--kv-capacity", "1000"], ["--profile", "'fp16'", "bf16", "k8v4"]),
        (["layout", "--profile", "fp16", "--head-dim", "64"], ["--profile", "'fp16'", "nvfp4-g16"]),
        (["layout", "--profile", "bf16", "--head-dim", "0"], ["--head-dim", "0", ">= 1"]),
        (["layout", "--profile", "int8-g64", "--head-dim", "96"], ["--profile int8-g64", "--head-dim 96", "% 64"]),
        (["layout", "--profile", "nvfp4-g16", "--head-dim", "40"], ["nvfp4-g16", "--head-dim 40", "% 16"]),
        (["layout", "--profile", "bf16", "--head-dim", "64", "--order", "diagonal"], ["'diagonal'", "page-major, head-major"]),
        (["layout", "--profile", "bf16", "--head-dim", "64", "--layers", "2"], ["--layers", "--kv-heads"]),
        (["layout", "--profile", "bf16", "--head-dim", "1000000000000"], ["--head-dim 1000000000000", "[1, 65536]"]),
        (["layout", "--profile", "bf16", "--head-dim", "64", "--layers", "5000", "--kv-heads", "1"], ["--layers 5000", "[1, 4096]"]),
        (["layout", "--profile", "bf16", "--head-dim", "64", "--layers", "1", "--kv-heads", "70000"], ["--kv-heads 70000", "[1, 65536]"]),
        (["layout", "--profile", "bf16", "--head-dim", "64", "--layers", "1", "--kv-heads", "1", "--pages", str(2**31 + 1)],
         ["--pages 2147483649", "[1, 2147483648]", "int32"]),
        (["layout", "--profile", "bf16", "--head-dim", "65536", "--layers", "4096", "--kv-heads", "65536", "--pages", "2048"],
         ["--pages 2048", "[1, 2047]", "int64"]),
        (["layout", "--kv-cache-dtype", "fp9", "--head-dim", "64"], ["--kv-cache-dtype", "'fp9'", "fp8 (fp8-e4m3fn-row256)"]),
        (SMALL + ["--kv-capacity", "999"], ["--kv-capacity 999", "[1000, 8192]"]),
        (SMALL + ["--kv-capacity", "9000"], ["--kv-capacity 9000", "[1000, 8192]"]),
        (SMALL + ["--free-bytes", "1000"], ["--free-bytes 1000", "too small", "B_min", "--headroom-bytes (the default; not on"]),
        (SMALL + ["--free-bytes", "1MiB", "--headroom-bytes", "1GiB"], ["--free-bytes 1048576", "1073741824"]),
        (SMALL + ["--free-bytes", "1GiB", "--speculative", "eagle"], ["'eagle'", "off, mtp, dflash, dflash2"]),
        (SMALL + ["--free-bytes", "40 parsecs"], ["--free-bytes", "'40 parsecs'", "GiB"]),
        (SMALL + ["--free-bytes", "0.5"], ["'0.5'", "whole number"]),
        (SMALL + ["--free-bytes=-1GiB"], ["'-1GiB'"]),
        (SMALL + ["--free-bytes", "1e99999"], ["--free-bytes", "'1e99999'", "int64"]),
        (SMALL + ["--free-bytes", "1e19"], ["--free-bytes", "10000000000000000000", "9223372036854775807"]),
        (SMALL + ["--free-bytes", "9e18", "--max-concurrency", "1000000000"], ["--free-bytes 9000000000000000000", "int32"]),
        (SMALL, ["--kv-capacity", "--free-bytes", "required"]),
        (SMALL + ["--kv-capacity", "1000", "--free-bytes", "1GiB"], ["not allowed"]),
        (SMALL + ["--kv-capacity", "1000", "--headroom-bytes", "1"], ["--headroom-bytes", "--free-bytes"]),
        (SMALL + ["--kv-capacity", "1000", "--draft-window", "4"], ["--draft-window", "mtp"]),
        (SMALL + ["--kv-capacity", "1000", "--speculative", "mtp", "--draft-full-layers", "1"], ["--draft-full-layers", "dflash"]),
        (SMALL + ["--kv-capacity", "1000", "--speculative", "mtp", "--draft-window", "0"], ["--draft-window", "0", ">= 1"]),
        (SMALL + ["--kv-capacity", "1000", "--speculative", "mtp", "--draft-window", "100000"],
         ["--draft-window 100000", "[1, 1000]", "--max-context 1000"]),
        (SMALL + ["--kv-capacity", "1000", "--max-concurrency", "many"], ["'many'", "integer >= 1"]),
        (SMALL + ["--kv-capacity", "1000", "--max-concurrency", str(2**31)], ["--max-concurrency 2147483648", "int32"]),
        (SMALL + ["--kv-capacity", "1000", "--max-context", str(2**31)], ["--max-context 2147483648", "[1, 2147483584]"]),
        (SMALL + ["--kv-capacity", "1000", "--layers", "9" * 5000], ["--layers", "5000 digits", "too large"]),
        (SMALL + ["--kv-capacity", str(10**17), "--max-concurrency", "1000000000"], ["--kv-capacity 100000000000000000", "int32"]),
        (SMALL + ["--kv-capacity", "1000", "--fixed-bytes", "9223372036854775807"], ["B_min", "int64", "--fixed-bytes 9223372036854775807"]),
        ("plan --layers 4096 --kv-heads 65536 --head-dim 65536 --profile bf16 --max-context 2147483584 "
         "--max-concurrency 64 --free-bytes 1GiB".split(), ["B_min", "int64"]),
        (SMALL + ["--kv-capacity", "1000", "--unknown"], ["unrecognized", "--unknown"]),
        (["demo", "--kv-cache-dtype", "fp9"], ["--kv-cache-dtype", "'fp9'"]),
        (["demo", "--requests", "100000000000"], ["--requests", "[1, 16384]"]),
        (["demo", "--system-prompts", "100000000000"], ["--system-prompts", "[0, 256]"]),
        (["demo", "--system-prompt-tokens", "100000000000"], ["--system-prompt-tokens", "[1, 65536]"]),
        (["demo", "--max-context", "100000000000"], ["--max-context", "[1, 65536]"]),
        (["demo", "--seed", "99999999999999999999999"], ["--seed", "[0, 4294967295]"]),
        (["demo", "--host-bytes", "9e18"], ["--host-bytes 9000000000000000000", "this machine's memory"]),
        (["frobnicate"], ["'frobnicate'", "layout", "plan"]),
        ([], ["command is required"]),
    ],
)
def test_bad_values_exit_2_with_one_line(capsys, argv, needles):
    assert_usage_error(capsys, argv, *needles)


def test_bad_value_in_json_mode_prints_nothing_on_stdout(capsys):
    assert_usage_error(capsys, SMALL + ["--kv-capacity", "1", "--json"], "--kv-capacity 1")


def test_a_default_the_user_did_not_type_is_named_as_such(capsys):
    err = assert_usage_error(capsys, SMALL + ["--free-bytes", "1000", "--headroom-bytes", "0"], "--free-bytes 1000")
    assert "the default" not in err
    big = ["layout", "--profile", "bf16", "--head-dim", "65536", "--layers", "4096", "--kv-heads", "65536"]
    assert run_json(capsys, big)["pool"]["page_bytes"] == 2**52  # 4 PiB per page still fits int64
    err = assert_usage_error(capsys, big[:-2] + ["--kv-heads", "65536", "--order", "head-major"] + ["--pages", "4096"],
                             "--pages 4096", "int64")
    assert "the default" not in err


def test_kv_cache_dtype_is_an_alias_of_profile(capsys):
    for short, profile in [("bf16", "bf16"), ("fp8", "fp8-e4m3fn-row256"), ("int8", "int8-g64"), ("nvfp4", "nvfp4-g16"),
                           ("k8v4", "k8v4"), ("INT8", "int8-g64")]:
        assert run_json(capsys, ["layout", "--kv-cache-dtype", short, "--head-dim", "128"])["profile"] == profile
        assert run_json(capsys, ["layout", "--profile", short, "--head-dim", "128"])["profile"] == profile
    js = run_json(capsys, [a if a != "--profile" else "--kv-cache-dtype" for a in SMALL] + ["--kv-capacity", "1000"])
    assert js["pools"]["main"]["profile"] == "bf16"


@pytest.mark.parametrize("backend", ["dflash", "dflash2"])
def test_dflash_without_draft_layers_says_it_plans_none(capsys, backend):
    js = run_json(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", backend])
    assert set(js["pools"]) == {"main"} and "plans no Draft Full pool" in js["notes"][0]
    code, out, err = run(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", backend])
    assert code == 0 and err == "" and "no Draft Full pool planned" in out and "--draft-full-layers N" in out
    assert run_json(capsys, SMALL + ["--kv-capacity", "1000", "--speculative", backend, "--draft-full-layers", "1"])["notes"] == []


def test_an_unexpected_failure_is_one_line_without_traceback(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("disk on fire\nsecond line")

    monkeypatch.setattr(cli, "_REGISTRY", dict(cli._REGISTRY))
    cli.register_subcommand("boom", help="fails", configure=lambda p: None, run=boom)
    monkeypatch.delenv("NINFER_KV_TRACEBACK", raising=False)
    code, out, err = run(capsys, ["boom"])
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "internal error: RuntimeError: disk on fire second line" in err and "Traceback" not in err


# -- plan --model DIR: the model's numbers from a checkpoint's config.json ------------------------
def _checkpoint_dir(tmp_path, family="llama", name=None, **overrides):
    """A checkpoint directory holding only ``config.json`` (plan reads no weights)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
    try:
        from hf_fixtures import FAMILY_CONFIGS
    finally:
        sys.path.pop(0)
    cfg = {**FAMILY_CONFIGS[family], **overrides}
    directory = tmp_path / (name or f"{family}-ckpt")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory, cfg


MODEL_TAIL = ["--profile", "k8v4", "--max-concurrency", "8", "--kv-capacity", "4096"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
def test_plan_model_json_is_the_plan_of_its_numbers(capsys, tmp_path, family):
    directory, cfg = _checkpoint_dir(tmp_path, family)
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    js = run_json(capsys, ["plan", "--model", str(directory)] + MODEL_TAIL)
    assert js.pop("model") == {
        "path": str(directory), "architecture": cfg["architectures"][0], "family": family, "layers": layers,
        "kv_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": cfg["max_position_embeddings"],
        "window_layers": 0, "window": None,
    }
    by_flags = ["plan", "--layers", str(layers), "--kv-heads", str(kv_heads), "--head-dim", str(head_dim),
                "--max-context", str(cfg["max_position_embeddings"])] + MODEL_TAIL
    assert js == run_json(capsys, by_flags)  # --max-context defaults to max_position_embeddings
    assert js["max_context"] == 4096 and js["pools"]["main"]["kv_heads"] == kv_heads


def test_plan_model_table_names_the_checkpoint(capsys, tmp_path):
    directory, _ = _checkpoint_dir(tmp_path, "mistral")
    code, out, err = run(capsys, ["plan", "--model", str(directory)] + MODEL_TAIL)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "KV plan"
    assert lines[1].split() == ["checkpoint", str(directory), "(MistralForCausalLM)"]
    assert "2 layers, 1 KV head, head dim 64; max_position_embeddings 4,096 (the max context S)" in lines[2]
    assert "4,096 tokens (L = ceil(S/P) = 64 logical pages)" in out
    assert any(line.split()[:6] == ["main", "k8v4", "page-major", "2", "1", "64"] for line in lines)
    # an explicit --max-context (here by its alias --max-model-len) below the model's context
    code, out, _ = run(capsys, ["plan", "--model", str(directory), "--max-model-len", "1000"] + MODEL_TAIL)
    assert code == 0 and "1,000 tokens (L = ceil(S/P) = 16 logical pages)" in out and "(the max context S)" not in out


def test_plan_model_over_a_mesh(capsys, tmp_path):
    directory, _ = _checkpoint_dir(tmp_path, "qwen3")
    argv = ["plan", "--model", str(directory), "--mesh", "data=2,model=2", "--profile", "bf16", "--max-concurrency", "8",
            "--kv-capacity", "16384"]
    js = run_json(capsys, argv)
    assert js["model"]["architecture"] == "Qwen3ForCausalLM" and js["kv_heads"] == 2
    code, out, _ = run(capsys, argv)
    assert code == 0 and out.startswith("KV plan over a device mesh\n  checkpoint")
    assert "(Qwen3ForCausalLM)" in out


def test_vllm_names_are_aliases(capsys, tmp_path):
    base = SMALL[:-4] + ["--kv-capacity", "1000"]  # SMALL without --max-context and --max-concurrency
    assert SMALL[-4:] == ["--max-context", "1000", "--max-concurrency", "8"]
    expect = run_json(capsys, SMALL + ["--kv-capacity", "1000"])
    assert run_json(capsys, base + ["--max-model-len", "1000", "--max-num-seqs", "8"]) == expect
    assert run_json(capsys, base + ["--max-model-len=1000", "--max-concurrency", "8"]) == expect
    directory, _ = _checkpoint_dir(tmp_path)
    tail = ["--profile", "bf16", "--kv-capacity", "4096"]
    assert (run_json(capsys, ["plan", "--model", str(directory), "--max-num-seqs", "4", "--max-model-len", "2048"] + tail)
            == run_json(capsys, ["plan", "--model", str(directory), "--max-concurrency", "4", "--max-context", "2048"]
                        + tail))
    assert_usage_error(capsys, base + ["--max-model-len", "0", "--max-num-seqs", "8"], "--max-model-len", "0", ">= 1")
    assert_usage_error(capsys, base + ["--max-model-len", "1000", "--max-num-seqs", "x"], "--max-num-seqs", "'x'")
    assert_usage_error(capsys, base + ["--max-model-len", "1000", "--max-num-seqs", str(2**31)],
                       "--max-concurrency 2147483648", "int32")


@pytest.mark.parametrize("flags", [["--layers", "2"], ["--kv-heads", "2"], ["--head-dim", "64"],
                                   ["--layers", "2", "--kv-heads", "2", "--head-dim", "64"]])
def test_plan_model_excludes_the_numbers(capsys, tmp_path, flags):
    directory, _ = _checkpoint_dir(tmp_path)
    err = assert_usage_error(capsys, ["plan", "--model", str(directory)] + flags + MODEL_TAIL + ["--json"],
                             "not allowed with argument --model", "config.json")
    assert all(f in err for f in flags if f.startswith("--"))


def test_plan_model_errors(capsys, tmp_path):
    directory, _ = _checkpoint_dir(tmp_path)
    missing = tmp_path / "nowhere"
    assert_usage_error(capsys, ["plan", "--model", str(missing)] + MODEL_TAIL, f"--model {missing}: no such directory")
    assert_usage_error(capsys, ["plan", "--model", str(directory / "config.json")] + MODEL_TAIL,
                       "config.json: not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_usage_error(capsys, ["plan", "--model", str(empty)] + MODEL_TAIL, f"--model {empty}", "no config.json")
    (empty / "config.json").write_text("{not json")
    assert_usage_error(capsys, ["plan", "--model", str(empty)] + MODEL_TAIL, str(empty / "config.json"))
    assert_usage_error(capsys, ["plan", "--model", str(directory), "--max-context", "5000"] + MODEL_TAIL,
                       "--max-context 5000", "max_position_embeddings=4096", "at most 4096")
    assert_usage_error(capsys, ["plan", "--model", str(directory), "--max-model-len", "5000"] + MODEL_TAIL,
                       "--max-context 5000", "max_position_embeddings=4096")
    # what the command line takes is still checked (the default context is the model's)
    assert_usage_error(capsys, ["plan", "--model", str(directory), "--profile", "bf16", "--max-concurrency", "8",
                                "--kv-capacity", "10"], "--kv-capacity 10", "--max-context 4096 (the default")


def test_plan_model_with_sliding_windows_plans_its_rings(capsys, tmp_path):
    # Mistral slides every layer: no global layer, so every layer stays in the Main pool
    windowed, _ = _checkpoint_dir(tmp_path, "mistral", name="windowed", sliding_window=1024)
    js = run_json(capsys, ["plan", "--model", str(windowed)] + MODEL_TAIL)
    assert js["rings"] is None and js["pools"]["main"]["layers"] == 2 and js["model"]["window_layers"] == 0
    # Gemma 3 (five windowed layers to one global): the windowed ones in rings
    gemma = tmp_path / "gemma3"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps(dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=512, hidden_size=128,
        intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=8192, sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0)))
    js = run_json(capsys, ["plan", "--model", str(gemma), "--max-context", "4096"] + MODEL_TAIL)
    assert js["pools"]["main"]["layers"] == 1 and js["rings"]["layers"] == 5 and js["rings"]["window"] == 512
    assert js["model"]["window_layers"] == 5 and js["model"]["layers"] == 1
    code, out, _ = run(capsys, ["plan", "--model", str(gemma), "--max-context", "4096"] + MODEL_TAIL)
    assert code == 0 and "1 full-attention layer + 5 sliding-window layers (window 512)" in out and "window rings" in out
    assert_usage_error(capsys, ["plan", "--model", str(gemma), "--window", "64", "--window-layers", "2"] + MODEL_TAIL,
                       "not allowed with argument --model")


def test_plan_model_refusals_name_the_config(capsys, tmp_path):
    gpt2, _ = _checkpoint_dir(tmp_path, "llama", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert_usage_error(capsys, ["plan", "--model", str(gpt2)] + MODEL_TAIL, f"--model {gpt2}", "GPT2LMHeadModel")
    odd, _ = _checkpoint_dir(tmp_path, "llama", name="odd", head_dim=96)
    err = assert_usage_error(capsys, ["plan", "--model", str(odd), "--profile", "int8", "--max-concurrency", "8",
                                      "--kv-capacity", "4096"], f"--model {odd}", "--profile int8-g64", "head_dim=96",
                             "% 64")
    assert "--head-dim" not in err and "the default" not in err  # the head dim is the model's, not a flag
    err = assert_usage_error(capsys, ["plan", "--model", str(odd), "--mesh", "data=1,model=3"] + MODEL_TAIL,
                             "num_key_value_heads=2", "model axis of size 3")
    assert "--kv-heads" not in err


def test_plan_without_model_requires_its_numbers(capsys):
    tail = ["--profile", "bf16", "--max-concurrency", "8", "--kv-capacity", "1000"]
    assert_usage_error(capsys, ["plan", "--layers", "2"] + tail, "required", "--kv-heads, --head-dim, --max-context",
                       "--model DIR")
    err = assert_usage_error(capsys, ["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "64"] + tail,
                             "required: --max-context")
    assert "--model" not in err
    assert_usage_error(capsys, ["plan", "--max-context", "1000"] + tail, "--layers, --kv-heads, --head-dim")


# -- fuzz: numeric flags never give a traceback ---------------------------------------------------
_NUMBERS = st.one_of(
    st.integers(-3, 300),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 63, 64, 65, 2**31 - 64, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 10**30]),
).map(str) | st.sampled_from(["", "x", "1.5", "1e3", "-0", "+7", "0x10", " 12 "])
_BYTE_TEXTS = _NUMBERS | st.sampled_from(["1e18", "1e19", "9e18", "40GiB", "1e400", "1e-3", "8EiB", "0.5KiB"])
_PLAN_INT_FLAGS = ["--layers", "--kv-heads", "--head-dim", "--max-context", "--max-concurrency", "--kv-capacity",
                   "--draft-window", "--mtp-layers", "--draft-full-layers", "--draft-kv-heads", "--draft-head-dim"]
_PLAN_BYTE_FLAGS = ["--free-bytes", "--headroom-bytes", "--fixed-bytes"]


def _main_captured(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _check_outcome(argv, code, out, err):
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err
    if code == 2:
        assert out == "" and err.startswith("ninfer-kv") and err.count("\n") == 1, (argv, err)
    else:
        assert err == "" and isinstance(json.loads(out), dict), (argv, out)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), backend=st.sampled_from(["off", "mtp", "dflash", "dflash2"]))
def test_fuzz_plan_numeric_flags(data, backend):
    base = {"--layers": "2", "--kv-heads": "2", "--head-dim": "64", "--max-context": "1000", "--max-concurrency": "8"}
    chosen = data.draw(st.lists(st.sampled_from(_PLAN_INT_FLAGS + _PLAN_BYTE_FLAGS), min_size=1, max_size=4, unique=True))
    values = dict(base)
    for flag in chosen:
        values[flag] = data.draw(_BYTE_TEXTS if flag in _PLAN_BYTE_FLAGS else _NUMBERS, label=flag)
    if "--kv-capacity" not in values and "--free-bytes" not in values:
        values["--free-bytes"] = "1GiB"
    argv = ["plan", "--profile", "bf16", "--speculative", backend, "--json"]
    for flag, value in values.items():
        argv.append(f"{flag}={value}")
    _check_outcome(argv, *_main_captured(argv))


@settings(max_examples=40, deadline=None)
@given(
    profile=st.sampled_from(sorted({p.value for p in KVProfile} | set(PROFILE_ALIASES))),  # every name --kv-cache-dtype takes
    head_dim=_NUMBERS,
    pool=st.one_of(st.none(), st.tuples(_NUMBERS, _NUMBERS, st.one_of(st.none(), _NUMBERS))),
)
def test_fuzz_layout_numeric_flags(profile, head_dim, pool):
    argv = ["layout", "--kv-cache-dtype", profile, f"--head-dim={head_dim}", "--json"]
    if pool is not None:
        argv += [f"--layers={pool[0]}", f"--kv-heads={pool[1]}"] + ([f"--pages={pool[2]}"] if pool[2] else [])
    _check_outcome(argv, *_main_captured(argv))


# -- byte sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value",
    [
        ("0", 0),
        ("123", 123),
        ("1e9", 10**9),
        ("2.5e3", 2500),
        ("40GiB", 40 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("1KB", 1000),
        ("2G", 2 * 10**9),
        ("1TiB", 2**40),
        ("7b", 7),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1", "1.2.3", "5 XB", "0.3KiB", "1e-3", "nan", "inf"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


def test_format_bytes():
    assert units.format_bytes(512) == "512 B"
    assert units.format_bytes(823296) == "804.0 KiB"
    assert units.format_bytes(40 * 2**30) == "40.00 GiB"


# -- registry -------------------------------------------------------------------------------------
def test_register_subcommand(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_REGISTRY", dict(cli._REGISTRY))

    def configure(p):
        p.add_argument("--n", type=cli.POSITIVE_INT, required=True)

    @cli.register_subcommand("echo-n", help="echo n", configure=configure)
    def _run(args):
        if args.n == 13:
            raise ValueError("n=13 is unlucky; allowed: any other integer >= 1")
        return cli.CommandOutput(data={"n": args.n}, text=f"n is {args.n}")

    assert "echo-n" in cli.registered_subcommands()
    assert run_json(capsys, ["echo-n", "--n", "3"]) == {"n": 3}
    assert run(capsys, ["echo-n", "--n", "3"])[1] == "n is 3\n"
    assert_usage_error(capsys, ["echo-n", "--n", "13"], "ninfer-kv echo-n: error: n=13 is unlucky")
    with pytest.raises(ValueError, match="already registered"):
        cli.register_subcommand("plan", help="x", configure=configure, run=_run)
    with pytest.raises(ValueError, match="invalid"):
        cli.register_subcommand("Bad Name", help="x", configure=configure, run=_run)


def test_help_and_version_exit_0(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and ninfer_kv.__version__ in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--free-bytes" in out and "--draft-window" in out


# -- entry points ---------------------------------------------------------------------------------
def _env():
    env = dict(os.environ)
    root = str(Path(ninfer_kv.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def test_python_dash_m(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ninfer_kv", *REALISTIC, "--json"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["main_pages"] == 32768
    bad = subprocess.run(
        [sys.executable, "-m", "ninfer_kv", "layout", "--profile", "fp16", "--head-dim", "64"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "'fp16'" in bad.stderr


def test_console_script(tmp_path):
    script = Path(sys.executable).parent / ("ninfer-kv.exe" if os.name == "nt" else "ninfer-kv")
    if not script.exists():
        pytest.skip(f"the ninfer-kv console script is not installed next to {sys.executable}")
    proc = subprocess.run(
        [str(script), *REALISTIC], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "main" in proc.stdout and "mtp" in proc.stdout


def test_package_ships_py_typed():
    from importlib import resources

    assert resources.files("ninfer_kv").joinpath("py.typed").is_file()


def test_plan_window_rings(capsys):
    argv = ["plan", "--layers", "5", "--kv-heads", "4", "--head-dim", "256", "--window-layers", "29", "--window",
            "1024", "--max-context", "32768", "--max-concurrency", "4", "--kv-capacity", "131072", "--profile", "bf16"]
    code, out, _ = run(capsys, argv)
    assert code == 0 and "window rings" in out and "k = ceil((W + T - 2) / P) + 1 = 25" in out
    data = run_json(capsys, argv)
    assert data["rings"]["layers"] == 29 and data["rings"]["pages_per_row"] == 25 and data["rings"]["rows"] == 4
    main = data["pools"]["main"]
    assert data["device_bytes"] == main["bytes"] + main["table_bytes"] + data["rings"]["bytes"]
    assert_usage_error(capsys, argv[:9] + argv[11:], "--window-layers needs --window")
    assert_usage_error(capsys, ["plan", "--layers", "5", "--kv-heads", "4", "--head-dim", "256", "--ring-step-tokens",
                                "64", "--max-context", "4096", "--max-concurrency", "4", "--kv-capacity", "8192",
                                "--profile", "bf16"],
                       "--ring-step-tokens applies only")
