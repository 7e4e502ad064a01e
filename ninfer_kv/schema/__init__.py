"""The package's vocabulary: plain Python and numpy data that every layer above shares, no JAX.

* :mod:`.errors` — the typed errors of the store and the device layer;
* :mod:`.integers`, :mod:`.sizes` — integer arguments, byte sizes people type;
* :mod:`.geometry` — the page size and the two plane orders;
* :mod:`.kinds` — the pool kinds and speculative methods;
* :mod:`.profiles` — the closed KV profiles and their codec spec table;
* :mod:`.layout` — :class:`~.layout.PagedKVStorageLayout`, a profile's planes per layer;
* :mod:`.mesh_spec` — the shape of a data x model mesh;
* :mod:`.round_work` — what the store hands the device: round works, offload requests, sync status;
* :mod:`.buckets` — every bucket ladder and the step-work shapes that bound a loop's programs;
* :mod:`.version` — the package version.

Nothing here imports JAX or any other part of the package (``tests/test_import_layers.py``).
"""
