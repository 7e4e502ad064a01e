"""The demo over a ``data x model`` device mesh: which configurations a mesh can serve.

A mesh serves the main model only (``speculative="off"``), through
:class:`~ninfer_kv.engine.data_parallel.DataParallelEngine` (:mod:`.serve`): the requests are split
over the data shards, so ``max_concurrency`` must split over them, and the model axis splits the
query heads and the KV heads (or replicates the KV heads when it is a multiple of their count).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..schema.mesh_spec import MeshSpec

if TYPE_CHECKING:  # pragma: no cover
    from ..models.decoder import ModelConfig

__all__ = ["check_mesh"]


def check_mesh(mesh, *, model_name: str, model: ModelConfig, speculative: str, max_concurrency: int) -> MeshSpec:
    """``mesh`` parsed (:meth:`MeshSpec.parse`); ``ValueError`` unless the demo can serve ``model``
    (named ``model_name``) with ``speculative`` and ``max_concurrency`` lanes in total over it."""
    mesh = MeshSpec.parse(mesh)
    if speculative != "off":
        raise ValueError(f"speculative={speculative!r} runs on one device only; with mesh={mesh} it must be 'off'")
    mesh.local_concurrency(max_concurrency)
    h, t = model.num_kv_heads, mesh.model
    if h % t and t % h:
        raise ValueError(
            f"model {model_name!r} has {h} KV heads; they do not fit the model axis of size {t}: it must "
            f"divide {h} or be a multiple of it"
        )
    if model.num_heads % mesh.model:
        raise ValueError(
            f"the model's {model.num_heads} query heads do not split over the model axis of size {mesh.model}"
        )
    return mesh
