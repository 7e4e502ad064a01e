"""Static limits of the Pallas kernels (checked before a kernel is built)."""

from __future__ import annotations

from ninfer_kv.profiles import KVCodec, KVProfile

__all__ = ["check_head_dim", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 512


def check_head_dim(profile: KVProfile, head_dim: int) -> None:
    """Raise ``ValueError`` unless the kernels can tile ``head_dim`` for ``profile``.

    Kernel tiles must be powers of two and the tensor-core products need at least 16 lanes, so D is
    a power of two in [16, 512] (NVFP4 products run over D/2 lanes: D >= 32 there); the profile's
    own rule (INT8 D % 64, NVFP4 D % 16) applies too.
    """
    profile.check_head_dim(head_dim)
    lo = 32 if KVCodec.NVFP4_G16 in (profile.k_codec, profile.v_codec) else 16
    if head_dim & (head_dim - 1) or not lo <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"profile {profile.value}: head_dim={head_dim} is not supported by the Pallas kernels; "
            f"it must be a power of two in [{lo}, {MAX_HEAD_DIM}]"
        )
