"""The chunk pipeline that the service and direct-writing clients both run:

    tensor pieces -> split (:mod:`.split`: fixed chunks, tensors hashed)
                  -> plan (:mod:`.plan`: each chunk's base in the parent, or its fp32 master)
                  -> encode (:mod:`.encode`: the codec pool, in order, within a :class:`Budget`)
                  -> a :class:`ChunkSink` (:mod:`.sink`: where the encoded bytes go)

:class:`ChunkPipeline` runs the stages over one body and returns the rows to commit
(:class:`Stored`: :class:`TensorInfo` and :class:`NewChunk` rows, :mod:`.rows`). Who runs it
supplies the parent's chunks (:class:`ChunkInfo`) to the :class:`DeltaPlanner`, a
:class:`BaseReader` for the parent's bytes, a file for the raw bytes (what each chunk loads
to, at its data-section offset) and the sink; durability and the commit stay theirs.
Torch-free, like the rest of the core.
"""

from ckptstore_core.pipeline.budget import Budget
from ckptstore_core.pipeline.chunks import ChunkPipeline, Stored
from ckptstore_core.pipeline.encode import BaseReader, EncodePipeline, FileBases
from ckptstore_core.pipeline.plan import (
    BaseChunk,
    ChunkPlan,
    DeltaPlanner,
    LossySave,
    lossy_params,
    same_offsets,
)
from ckptstore_core.pipeline.rows import ChunkInfo, NewChunk, TensorInfo
from ckptstore_core.pipeline.sink import Buffer, ChunkSink
from ckptstore_core.pipeline.split import RawChunk, Splitter

__all__ = [
    "BaseChunk",
    "BaseReader",
    "Budget",
    "Buffer",
    "ChunkInfo",
    "ChunkPipeline",
    "ChunkPlan",
    "ChunkSink",
    "DeltaPlanner",
    "EncodePipeline",
    "FileBases",
    "LossySave",
    "NewChunk",
    "RawChunk",
    "Splitter",
    "Stored",
    "TensorInfo",
    "lossy_params",
    "same_offsets",
]
