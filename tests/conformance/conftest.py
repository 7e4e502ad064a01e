"""The ``backend`` fixture: every registered backend, skipped with its reason where it cannot load.

Backends run in an interpreter on the CPU (``"pallas_tpu"``: TPU interpret mode, which simulates
every DMA and semaphore) take the default run's small cases listed in :data:`INTERPRETED_DEFAULT`
only; their other cases carry the ``slow`` marker (``-m slow`` runs them).
"""

import pytest

from .backends import BACKENDS, require

INTERPRETED_DEFAULT = {
    "pallas_tpu": {
        "test_attention_matches_the_oracle[pallas_tpu-k8v4]",
        "test_paged_attention_masks_what_the_rules_mask",
        "test_paged_append_drops_what_the_rules_drop",
        "test_ragged_attention_is_each_rows_attention[pallas_tpu-k8v4]",
        "test_ragged_append_is_each_rows_append[pallas_tpu-k8v4]",
        "test_ragged_starts_out_of_order_under_jit_are_clamped",
        "test_variant_attention_matches_the_oracle",
        "test_ragged_variant_attention_is_each_rows_attention",
    },
}
"""Per interpreted backend: the tests that run for it by default (a test id may name one parametrization)."""

INTERPRETED_PROFILES = {"pallas": ("k8v4", "nvfp4-g16"), "pallas_tpu": ("k8v4",)}
"""Per interpreted backend: the profiles its profile-parametrized cases run with by default (the two
with scale planes and the most lane bookkeeping); the others under ``-m slow``."""

RAGGED_ONE_PROFILE = {"pallas": None, "reference": "k8v4"}
"""Backends whose profile-parametrized ragged cases run one profile by default (``None``: none), the
rest under ``-m slow``: the reference (its ragged ops are the generic form over kernels the
rectangular tests cover per profile) and the interpreted Pallas backend (its ragged kernels run the
rectangular kernels' bodies, which the rectangular cases cover per profile, padded head dims
included; ``tests/pallas/test_pallas_ragged.py`` holds its ragged attention (K8V4, both orders) and
appends (NVFP4) to the per-row model by default, and its clamped ``query_starts`` run here)."""


INTERPRETED_VARIANTS = {"pallas": ("all", "window-pages"), "pallas_tpu": ("all",)}
"""Per interpreted backend: the attention variants (``test_attention_variants``) its default run
takes (every option at once, and a window across pages); the others under ``-m slow``."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the interpreted backends' cases outside :data:`INTERPRETED_DEFAULT` ``slow`` (before ``-m`` deselects)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        keep = INTERPRETED_DEFAULT.get(params.get("backend"))
        if keep is not None and item.originalname not in keep and item.name not in keep:
            item.add_marker(pytest.mark.slow)
        default_profiles = INTERPRETED_PROFILES.get(params.get("backend"))
        if default_profiles is not None and "profile" in params and params["profile"].value not in default_profiles:
            item.add_marker(pytest.mark.slow)
        if (params.get("backend") in RAGGED_ONE_PROFILE and item.module.__name__.endswith("test_ragged")
                and "profile" in params and params["profile"].value != RAGGED_ONE_PROFILE[params["backend"]]):
            item.add_marker(pytest.mark.slow)
        variants = INTERPRETED_VARIANTS.get(params.get("backend"))
        if variants is not None and "variant" in params and params["variant"] not in variants:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    """The name of one registered backend; the test is skipped, with the reason, where it cannot load."""
    return require(request.param)
