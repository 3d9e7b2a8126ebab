"""ckptstore's torch-free core, shared by the client and the service.

- :mod:`ckptstore_core.errors`: the one error tree on both sides of the wire;
- :mod:`ckptstore_core.wire`: the safetensors framing (spec, encoder, a parser without I/O);
- :mod:`ckptstore_core.codec` and :mod:`ckptstore_core.planes`: residual encoding of chunks;
- :mod:`ckptstore_core.records`: the listing records the API serves and the client returns;
- :mod:`ckptstore_core.names`: the run-name rule, checked by the service and the client.

numpy, zstandard and xxhash only: importing it never imports torch.
"""
