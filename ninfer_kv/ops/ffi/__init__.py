"""The C++ XLA FFI CPU kernels, by client: :mod:`.kv` (the KV ops, the ``"ffi"`` backend of
:mod:`ninfer_kv.ops`), :mod:`.products` with :mod:`.packed_weight` (the model's weight products),
:mod:`.work_ops` (the device layer's round works) and :mod:`.handlers` (the library's handlers, levels
and availability; the library itself is loaded by :mod:`ninfer_kv.host.ffi_library`, without JAX)."""
