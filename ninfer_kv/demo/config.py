"""The configuration of one serving demo: :class:`DemoConfig`, the demo model sizes and speculative methods."""

from __future__ import annotations

import dataclasses
import os

from ..schema.integers import check_int
from ..schema.mesh_spec import MeshSpec
from ..models.decoder import ModelConfig
from ..ops.registry import impl_choices
from ..planning import AutomaticCapacity, ExplicitCapacity, SpeculativeConfig
from ..schema.profiles import KVProfile
from .checkpoint_cache import checkpoint_config
from .mesh import check_mesh
from .requests import WorkloadSpec

__all__ = ["DemoConfig", "MODELS", "SPECULATIVE_METHODS", "DEFAULT_KV_CAPACITY", "DEFAULT_HOST_BYTES"]

MODELS = {
    "tiny": dict(vocab_size=256, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=256),
    "small": dict(vocab_size=512, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128, mlp_dim=512),
}
"""Demo model sizes (float32 Qwen-style decoders with random weights).  ``DemoConfig.model`` may also be a
Hugging Face checkpoint directory (:mod:`ninfer_kv.models.hf`), served in float32 so the dense check's
tolerances apply, stopping at its EOS ids."""

SPECULATIVE_METHODS = ("off", "mtp")

DEFAULT_KV_CAPACITY = 24 * 64
DEFAULT_HOST_BYTES = 16 * 2**20

@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on.

    Attributes:
      workload: the requests to serve.
      model: a key of :data:`MODELS`, or a Hugging Face checkpoint directory (``speculative="off"``).
      profile: the KV profile of the Main (and MTP) pool.
      speculative: ``"off"`` or ``"mtp"`` (speculative decoding with the model's MTP head).
      draft_window: MTP draft window K (``speculative="mtp"`` only).
      impl: op implementation, one of :func:`ninfer_kv.ops.registry.impl_choices` (``"auto"``: FFI on CPU,
        Pallas on GPU, Mosaic on TPU).
      kv_lease_growth: lease a bounded window instead of the whole output budget.
      lease_window_tokens: the growth window (with ``kv_lease_growth``).
      lease_cushion_tokens: the per-lane cushion beyond the window: the tokens one decode round
        writes (1, or ``draft_window + 1`` with MTP), so the step about to launch is always covered.
      host_bytes: Host arena bytes for offloaded checkpoints (0: no Host tier).
      max_context, max_concurrency: S and C of the plan.
      capacity: the plan's capacity policy (explicit tokens or free bytes).
      fixed_bytes: the fixed part of ``B(M)``.
      seed: weights seed (the workload has its own seed).
      dense_check: recompute every request densely after the run.
      mesh: serve over a ``data x model`` device mesh (main model only, through
        :class:`~ninfer_kv.engine.data_parallel.DataParallelEngine`), or ``None`` for one device.  ``max_concurrency`` and ``kv_capacity`` are totals over
        the data shards, ``host_bytes`` is per data shard.
    """

    workload: WorkloadSpec = WorkloadSpec()
    model: str = "small"
    profile: KVProfile = KVProfile.BF16
    speculative: str = "off"
    draft_window: int = 3
    impl: str = "auto"
    kv_lease_growth: bool = False
    lease_window_tokens: int = 4096
    host_bytes: int = DEFAULT_HOST_BYTES
    max_context: int = 512
    max_concurrency: int = 8
    capacity: ExplicitCapacity | AutomaticCapacity = ExplicitCapacity(DEFAULT_KV_CAPACITY)
    fixed_bytes: int = 0
    seed: int = 0
    dense_check: bool = True
    mesh: MeshSpec | None = None

    def __post_init__(self):
        if not isinstance(self.workload, WorkloadSpec):
            raise TypeError(f"workload must be a WorkloadSpec, got {type(self.workload).__name__}")
        if self.model not in MODELS and not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r} is neither a demo model ({', '.join(MODELS)}) nor a checkpoint "
                             f"directory")
        if self.checkpoint is not None and self.speculative != "off":
            raise ValueError(f"speculative={self.speculative!r} needs the demo model's MTP head; a checkpoint directory "
                             f"({self.model}) is served with speculative 'off'")
        object.__setattr__(self, "profile", KVProfile.parse(self.profile))
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative={self.speculative!r} is not supported by the demo; allowed: {', '.join(SPECULATIVE_METHODS)}")
        check_int("draft_window", self.draft_window, 1)
        if self.impl not in impl_choices():
            raise ValueError(f"impl={self.impl!r} is not supported; allowed: {', '.join(impl_choices())}")
        for name, minimum in (("lease_window_tokens", 1), ("host_bytes", 0), ("max_context", 1),
                              ("max_concurrency", 1), ("fixed_bytes", 0), ("seed", 0)):
            check_int(name, getattr(self, name), minimum)
        if not isinstance(self.capacity, (ExplicitCapacity, AutomaticCapacity)):
            raise TypeError(f"capacity must be ExplicitCapacity or AutomaticCapacity, got {type(self.capacity).__name__}")
        self.model_config.kv_config(self.profile)  # head dim vs profile: a clear ValueError early
        if self.mesh is not None:
            object.__setattr__(self, "mesh", check_mesh(self.mesh, model_name=self.model, model=self.model_config,
                                                        speculative=self.speculative, max_concurrency=self.max_concurrency))

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint directory when ``model`` names one, else ``None``."""
        return None if self.model in MODELS else self.model

    @property
    def model_config(self) -> ModelConfig:
        """The model served (a demo size, or the checkpoint's configuration in float32)."""
        if self.checkpoint is not None:
            return checkpoint_config(self.checkpoint, self.max_context)[0]
        return ModelConfig(**MODELS[self.model], mtp=self.speculative == "mtp")

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Token ids that end a request: the checkpoint's EOS ids (none for the demo sizes)."""
        return () if self.checkpoint is None else checkpoint_config(self.checkpoint, self.max_context)[1]

    @property
    def lease_cushion_tokens(self) -> int:
        return self.draft_window + 1 if self.speculative == "mtp" else 1

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The plan's :class:`SpeculativeConfig` (``None`` without speculative decoding)."""
        return SpeculativeConfig("mtp", draft_window=self.draft_window) if self.speculative == "mtp" else None
