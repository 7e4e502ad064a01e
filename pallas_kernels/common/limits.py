"""Static limits every Pallas kernel backend supports (checked before a kernel is built)."""

from __future__ import annotations

from ninfer_kv.schema.profiles import KVProfile

__all__ = ["check_head_dim", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 512


def check_head_dim(profile: KVProfile, head_dim: int) -> None:
    """Raise ``ValueError`` unless the kernels can tile ``head_dim`` for ``profile``.

    Every head dim the profile's codecs accept (INT8 D % 64, NVFP4 D % 16, BF16 / FP8 any) up to
    512 runs: a backend pads its tiles to the widths its lowering needs (its
    :class:`~pallas_kernels.common.tiles.Lanes`) and masks the padding lanes in every load and store.
    """
    profile.check_head_dim(head_dim)
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"profile {profile.value}: head_dim={head_dim} is not supported by the Pallas kernels; "
            f"it must be in [1, {MAX_HEAD_DIM}]"
        )
