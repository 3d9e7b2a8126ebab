"""What a load keeps decoded (``DecodedChunks``): the chunk it was asked for, not every link
of its chain (each kept link is a copy into fresh memory: a deep cold load took twice as
long keeping them, docs/benchmarks.md); and the next load starts from the newest chunk kept."""

from __future__ import annotations

import numpy as np

from ckptstore_core import codec
from ckptstore_core.chain import ChainDecoder, DecodedChunks
from ckptstore_core.pipeline.rows import ChunkInfo

ITEMS = 64 << 10  # fp32 items per chunk: above the size under which no delta is tried


class Blobs:
    """An in-memory :class:`RangeReader`."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}

    def view(self, key: str, start: int, end: int) -> memoryview:
        return memoryview(self.blobs[key])[start:end]


def steps(n: int) -> list[np.ndarray]:
    """``n`` states of a tensor, each a few elements away from the one before."""
    rng = np.random.default_rng(n)
    state = rng.integers(0, 100, ITEMS).astype(np.float32)
    out = [state]
    for _ in range(n - 1):
        state = state.copy()
        state[rng.integers(0, ITEMS, ITEMS // 100)] += 1
        out.append(state)
    return out


def chain_of(states: list[np.ndarray], blobs: Blobs) -> dict[int, ChunkInfo]:
    """One chunk per state, each a delta of the one before (the first self-contained):
    chunk ids 1..n, each in a blob of its own."""
    closure: dict[int, ChunkInfo] = {}
    for i, raw in enumerate(states):
        base = states[i - 1].data if i else None
        enc = codec.encode_chunk(raw.data, base, 4)
        assert (i == 0) != codec.is_delta(enc.codec)  # a real chain: every next one a delta
        blobs.blobs[f"b{i}"] = enc.payload
        closure[i + 1] = ChunkInfo(
            tensor_idx=0,
            offset=0,
            raw_len=raw.nbytes,
            itemsize=4,
            codec=enc.codec,
            base_id=i or None,
            depth=i,
            blob_offset=0,
            stored_len=len(enc.payload),
            checksum=enc.checksum,
            id=i + 1,
            blob_key=f"b{i}",
            checkpoint_id=i + 1,
        )
    return closure


def decoded_links(
    closure: dict[int, ChunkInfo],
    blobs: Blobs,
    kept: DecodedChunks,
    chunk: int,
    want: np.ndarray,
    keep: bool = True,
) -> int:
    """Decode chunk ``chunk`` in a load of its own, check it is ``want``; the stored links
    it decoded."""
    decoder = ChainDecoder(blobs, closure, 0, decoded=kept, keep=keep)
    assert bytes(decoder.decode(closure[chunk])) == want.tobytes()
    return decoder.stats.links


def test_a_load_keeps_what_it_was_asked_for_and_the_next_starts_from_it() -> None:
    states = steps(5)
    blobs = Blobs()
    closure = chain_of(states, blobs)
    kept = DecodedChunks(1 << 30)

    assert decoded_links(closure, blobs, kept, 5, states[4]) == 5
    assert kept.nbytes == states[4].nbytes  # the chunk asked for only, no link below it
    assert kept.get(closure[5]) is not None and kept.get(closure[4]) is None
    # the chunk kept serves itself; a chunk below it decodes its own chain again...
    assert decoded_links(closure, blobs, kept, 5, states[4]) == 0
    assert decoded_links(closure, blobs, kept, 3, states[2]) == 3
    # ...and the next one up starts from it: one link
    assert decoded_links(closure, blobs, kept, 4, states[3]) == 1
    assert kept.nbytes == 3 * states[0].nbytes


def test_a_decoder_that_does_not_keep_leaves_the_kept_chunks_as_they_were() -> None:
    states = steps(2)
    blobs = Blobs()
    closure = chain_of(states, blobs)
    kept = DecodedChunks(1 << 30)
    assert decoded_links(closure, blobs, kept, 2, states[1], keep=False) == 2
    assert kept.nbytes == 0
