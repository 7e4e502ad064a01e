"""Shared vocabulary of pools and speculative methods (a leaf: imports nothing of the package).

:class:`PoolKind` names the growing pools (Main, MTP, Draft Full) every layer keys its state by;
:class:`SpeculativeMethod` names the mutually exclusive speculative methods that decide which
pools exist.
"""

from __future__ import annotations

import enum

__all__ = ["PoolKind", "SpeculativeMethod"]


class SpeculativeMethod(enum.Enum):
    """Speculative decoding methods; mutually exclusive within one engine.

    ``OFF``: Main pool only.  ``MTP``: a multi-token-prediction head with its own MTP pool.
    ``DFLASH`` / ``DFLASH2``: a draft model whose full-attention layers get a Draft Full pool
    (when :attr:`SpeculativeConfig.draft_full_layers` > 0).
    """

    OFF = "off"
    MTP = "mtp"
    DFLASH = "dflash"
    DFLASH2 = "dflash2"

    @classmethod
    def parse(cls, name: "str | SpeculativeMethod") -> "SpeculativeMethod":
        """Resolve ``"off"``, ``"mtp"``, ``"dflash"`` or ``"dflash2"`` (case and spaces ignored) or a member.

        Raises:
          ValueError: any other value, naming it and the allowed names.
        """
        if isinstance(name, SpeculativeMethod):
            return name
        if isinstance(name, str):
            for member in cls:
                if name.strip().lower() == member.value:
                    return member
        raise ValueError(f"unknown speculative method {name!r}; allowed: off, mtp, dflash, dflash2")


class PoolKind(str, enum.Enum):
    """The growing pools of the contract.

    ``MAIN``: the target model's KV (Main Text, page-major, the model's profile).  ``MTP``: the MTP
    head's KV (page-major, Main's profile and geometry).  ``DRAFT_FULL``: a DFlash draft model's
    full-attention KV (head-major, always BF16).  A ``str`` enum: ``PoolKind.MAIN == "main"``.
    """

    MAIN = "main"
    MTP = "mtp"
    DRAFT_FULL = "draft_full"

    @classmethod
    def parse(cls, name: "str | PoolKind") -> "PoolKind":
        """Resolve ``"main"``, ``"mtp"`` or ``"draft_full"`` (exact, lower case) or a member.

        Raises:
          ValueError: any other value, naming it and the allowed names.
        """
        if isinstance(name, PoolKind):
            return name
        for member in cls:
            if name == member.value:
                return member
        raise ValueError(f"unknown pool {name!r}; allowed: main, mtp, draft_full")
