"""Python takes what the command line takes: profile short names and byte-size strings.

* Every place that names a profile resolves the CLI's short names (``int8``, ``fp8``, ``nvfp4``, ...)
  through the one table :data:`ninfer_kv.schema.profiles.PROFILE_ALIASES`, and stores the canonical profile.
* Every Python argument that takes a byte count accepts the CLI's byte sizes (``"40GiB"``, ``"1e9"``)
  and refuses the rest with a clear ``TypeError`` / ``ValueError``.
* Byte counts in planning errors and CLI tables are printed by the one humanizer.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

from ninfer_kv.planning import AutomaticCapacity, ExplicitCapacity, KVPoolSetLayout, ModelKVConfig, SpeculativeConfig, plan_kv_cache
from ninfer_kv.ops.views import CyclicKVLayout
from ninfer_kv.host import HostKVArena
from ninfer_kv.schema.profiles import KVProfile
from ninfer_kv.store import KVStore
from ninfer_kv.schema.layout import PagedKVStorageLayout
from ninfer_kv.schema.kinds import PoolKind
from ninfer_kv import cli
from ninfer_kv.schema import sizes as units
from ninfer_kv.planning import PlanBoundError
from ninfer_kv.schema.profiles import PROFILE_ALIASES, profile_names
from ninfer_kv.schema.sizes import (
    ByteSizeTypeError,
    byte_count,
    describe_bytes,
    format_bytes,
    parse_bytes,
    to_byte_count,
)

SHORT_NAMES = {"fp8": KVProfile.FP8_E4M3FN_ROW256, "int8": KVProfile.INT8_G64, "nvfp4": KVProfile.NVFP4_G16}
ALL_NAMES = [(p.value, p) for p in KVProfile] + list(PROFILE_ALIASES.items())


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def _tiny_plan(**kwargs):
    return plan_kv_cache(ModelKVConfig(1, 1, 64, "bf16"), max_context=64, max_concurrency=1,
                         policy=kwargs.pop("policy", ExplicitCapacity(64)), **kwargs)


# -- profile names --------------------------------------------------------------------------------
def test_the_short_names_of_the_cli_are_in_the_table():
    for short, profile in SHORT_NAMES.items():
        assert PROFILE_ALIASES[short] is profile


@pytest.mark.parametrize("name, profile", ALL_NAMES)
def test_every_name_resolves_everywhere_a_profile_is_named(name, profile):
    for spelling in (name, name.upper(), f" {name} "):
        assert KVProfile.parse(spelling) is profile
        assert KVProfile(spelling) is profile
    model = ModelKVConfig(2, 2, 64, name)
    assert model.profile is profile and repr(model).count(profile.value) == 1
    assert PagedKVStorageLayout(name, 1, 1, 64).profile is profile
    assert CyclicKVLayout(name, 1, 1, 1, 64, 4).profile is profile
    plan = plan_kv_cache(model, max_context=64, max_concurrency=1, policy=ExplicitCapacity(64))
    assert plan.to_json()["pools"]["main"]["profile"] == profile.value  # the canonical name is printed


def test_model_config_accepts_int8():
    assert ModelKVConfig(2, 2, 64, "int8").profile is KVProfile.INT8_G64
    assert dataclasses.replace(ModelKVConfig(2, 2, 64), profile="fp8").profile is KVProfile.FP8_E4M3FN_ROW256


def test_the_cli_resolves_through_the_same_table():
    assert cli.KV_CACHE_DTYPES is PROFILE_ALIASES
    for name, profile in ALL_NAMES:
        assert cli.PROFILE(name) is profile
        for flag in ("--profile", "--kv-cache-dtype"):
            code, out, err = _cli(["layout", flag, name, "--head-dim", "64", "--json"])
            assert code == 0 and err == "" and json.loads(out)["profile"] == profile.value
    help_text = " ".join(cli.PROFILE_HELP.split())
    for name, profile in ALL_NAMES:
        assert name in help_text


def test_the_alias_table_is_read_only():
    with pytest.raises(TypeError):
        PROFILE_ALIASES["fp4"] = KVProfile.NVFP4_G16  # type: ignore[index]


@pytest.mark.parametrize("bad", ["fp16", "int4", "fp8_e5m2", "", None, 3])
def test_an_unknown_name_lists_every_name_and_short_name(bad):
    with pytest.raises(ValueError, match="unknown KV profile") as err:
        ModelKVConfig(1, 1, 64, bad)
    for name, profile in ALL_NAMES:
        assert name in str(err.value) and profile.value in str(err.value)
    with pytest.raises(ValueError, match="unknown KV profile"):
        KVProfile(bad)
    assert profile_names() in str(err.value)


def test_the_cli_error_for_an_unknown_name_is_the_python_one():
    code, out, err = _cli(["layout", "--kv-cache-dtype", "fp16", "--head-dim", "64"])
    assert code == 2 and out == "" and err.count("\n") == 1
    with pytest.raises(ValueError) as python:
        KVProfile.parse("fp16")
    assert str(python.value) in err


# -- byte sizes -----------------------------------------------------------------------------------
TEXTS = ["0", "123", "1e9", "2.5e3", "40GiB", "512MiB", "512 mib", "1.5GiB", "1KB", "2G", "1TiB", "7b", "0.5KiB"]


@pytest.mark.parametrize("text", TEXTS)
def test_planning_takes_the_cli_byte_sizes(text):
    n = parse_bytes(text)
    policy = AutomaticCapacity(text, headroom_bytes=text)
    assert (policy.free_bytes, policy.headroom_bytes) == (n, n)
    assert type(policy.free_bytes) is int and policy == AutomaticCapacity(free_bytes=n, headroom_bytes=n)
    assert KVPoolSetLayout(ModelKVConfig(1, 1, 64), 64, 1, fixed_bytes=text).fixed_bytes == n


def test_automatic_capacity_from_a_string_plans_like_the_integer():
    model = ModelKVConfig(16, 2, 256, "k8v4")
    kwargs = dict(max_context=32768, max_concurrency=64)
    by_text = plan_kv_cache(model, policy=AutomaticCapacity("40GiB"), fixed_bytes="1MiB", **kwargs)
    by_int = plan_kv_cache(model, policy=AutomaticCapacity(40 * 2**30), fixed_bytes=2**20, **kwargs)
    assert by_text.to_json() == by_int.to_json()
    assert dataclasses.replace(AutomaticCapacity(1), free_bytes="1KiB").free_bytes == 1024


@pytest.mark.parametrize("value, count", [(4e10, 40_000_000_000), (np.int64(7), 7), (np.uint32(9), 9),
                                          (np.float32(1024.0), 1024), (0.0, 0)])
def test_integers_and_whole_floats_are_byte_counts(value, count):
    assert AutomaticCapacity(value).free_bytes == count
    assert type(to_byte_count(value)) is int


def test_the_host_tier_takes_byte_sizes():
    assert HostKVArena("64KiB", prefault=False).capacity == 65536
    assert HostKVArena("1e5", alignment=256, prefault=False).capacity == 100096  # rounded up to the alignment
    assert HostKVArena(8192.0, prefault=False).capacity == 8192
    store = KVStore(_tiny_plan(), host_bytes="0.5MiB")
    assert "host_arena=524288" in repr(store)


def _byte_takers():
    """Every Python byte-count argument, as ``(name, minimum, call)``."""
    model = ModelKVConfig(1, 1, 64)
    return [
        ("free_bytes", 0, lambda v: AutomaticCapacity(v)),
        ("headroom_bytes", 0, lambda v: AutomaticCapacity(10**9, headroom_bytes=v)),
        ("fixed_bytes", 0, lambda v: KVPoolSetLayout(model, 64, 1, fixed_bytes=v)),
        ("fixed_bytes", 0, lambda v: _tiny_plan(fixed_bytes=v)),
        ("capacity_bytes", 1, lambda v: HostKVArena(v, prefault=False)),
        ("host_bytes", 1, lambda v: KVStore(_tiny_plan(), host_bytes=v)),
    ]


@pytest.mark.parametrize("bad", [True, False, np.bool_(True), None, [4096], b"4096", object()])
def test_a_wrong_type_is_a_type_error_naming_what_is_accepted(bad):
    for name, _, call in _byte_takers():
        if bad is None and name == "host_bytes":
            continue  # KVStore(host_bytes=None): no Host tier
        with pytest.raises(TypeError, match=f"{name}=.*is not a byte count; use an integer, a float") as err:
            call(bad)
        assert isinstance(err.value, ByteSizeTypeError) and isinstance(err.value, ValueError)
        assert "byte-size string such as '40GiB'" in str(err.value)


@pytest.mark.parametrize(
    "bad, needle",
    [
        (1.5, "=1.5 is not a whole number of bytes"),
        (float("nan"), "=nan is not a whole number"),
        (float("inf"), "=inf is not a whole number"),
        (-1, "=-1 is out of range; it must be a byte count in ["),
        (-4096.0, "=-4096.0 is out of range"),
        (2**63, "=9223372036854775808 (8.00 EiB) is out of range; it must be a byte count in ["),
        ("40 parsecs", "='40 parsecs' is invalid; use a non-negative integer"),
        ("-1GiB", "='-1GiB' is invalid"),
        ("0.3KiB", "='0.3KiB' is 307.2 bytes; it must be a whole number of bytes"),
        ("1e19", "='1e19' is 10000000000000000000 bytes; it must be at most 9223372036854775807 bytes (int64)"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_value_and_range(bad, needle):
    for name, _, call in _byte_takers():
        with pytest.raises(ValueError) as err:
            call(bad)
        assert not isinstance(err.value, TypeError)
        assert f"{name}{needle}" in str(err.value), str(err.value)
        if "out of range" in needle:
            assert "9,223,372,036,854,775,807 B (8.00 EiB)]" in str(err.value)


def test_planning_range_errors_stay_plan_bound_errors():
    with pytest.raises(PlanBoundError) as err:
        AutomaticCapacity(-5)
    assert (err.value.name, err.value.value) == ("free_bytes", -5)
    with pytest.raises(PlanBoundError, match="fixed_bytes="):
        KVPoolSetLayout(ModelKVConfig(1, 1, 64), 64, 1, fixed_bytes=2**63)


def test_the_host_tier_needs_at_least_one_byte():
    for name, minimum, call in _byte_takers():
        if minimum == 1:
            with pytest.raises(ValueError, match=rf"{name}='0' is out of range; it must be a byte count in \[1 B, "):
                call("0")


# -- one parser, one humanizer --------------------------------------------------------------------
def test_the_cli_uses_the_units_module():
    from ninfer_kv.cli import types

    assert types.parse_bytes is units.parse_bytes  # the command line parses byte sizes with the one parser
    assert not hasattr(cli, "_BYTE_UNITS") and not hasattr(cli, "_bytes")


def test_units_imports_nothing_from_the_package():
    tree = ast.parse(Path(units.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0 and not (node.module or "").startswith("ninfer_kv"), ast.dump(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("ninfer_kv") for a in node.names)


def test_humanizer():
    assert describe_bytes(34361835520) == "34,361,835,520 B (32.00 GiB)"
    assert describe_bytes(451428352) == "451,428,352 B (430.5 MiB)"
    assert describe_bytes(512) == "512 B" and describe_bytes(0) == "0 B"
    assert format_bytes(2**52) == "4.00 PiB" and format_bytes(2**63 - 1) == "8.00 EiB"
    assert byte_count("1KiB", minimum=1024, maximum=1024) == 1024


def test_a_too_small_free_bytes_prints_b_min_humanized():
    model = ModelKVConfig(16, 2, 256, "k8v4")
    b_min = KVPoolSetLayout(model, 32768, 64).curve().b_min
    with pytest.raises(ValueError) as err:
        plan_kv_cache(model, max_context=32768, max_concurrency=64, policy=AutomaticCapacity("100MiB"))
    msg = str(err.value)
    assert f"B_min = {describe_bytes(b_min)}" in msg
    assert f"{describe_bytes(100 * 2**20)} is given" in msg
    assert f"free_bytes={100 * 2**20} is too small" in msg  # the exact value, as the CLI rewrites it


def test_bound_errors_print_byte_counts_humanized():
    with pytest.raises(PlanBoundError, match=r"B_min=\d+ \(\d+\.\d+ EiB\) is out of range"):
        _tiny_plan(fixed_bytes=2**63 - 1)


def test_cli_plan_tables_print_byte_counts_with_the_humanizer():
    argv = ("plan --layers 16 --kv-heads 2 --head-dim 256 --kv-cache-dtype k8v4 --max-context 32768 "
            "--max-concurrency 64 --free-bytes 40GiB --speculative mtp --draft-window 4").split()
    code, out, err = _cli(argv)
    assert code == 0 and err == ""
    plan = plan_kv_cache(ModelKVConfig(16, 2, 256, "k8v4"), max_context=32768, max_concurrency=64,
                         policy=AutomaticCapacity("40GiB"), speculative=SpeculativeConfig("mtp", draft_window=4))
    for n in (plan.curve.b_min, plan.curve.b_step, plan.device_bytes, 40 * 2**30):
        assert describe_bytes(n) in out
    assert format_bytes(plan.pools[PoolKind.MAIN].bytes) in out
