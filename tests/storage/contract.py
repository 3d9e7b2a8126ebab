"""The one behavioural suite every BlobStore backend passes (see storage/base.py's contract).

A backend's test module subclasses :class:`BlobStoreContract` and provides the ``store``
fixture (an empty store) and ``leftovers`` (partial state a failed write could leave behind:
temp files, open multipart uploads).
"""

from __future__ import annotations

import array
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptstore_service.storage import BlobNotFound, BlobStore

MiB = 1 << 20


class Boom(Exception):
    """Raised by a test's producer to cut an upload short."""


class Interrupted(BaseException):
    """Like KeyboardInterrupt: not an Exception, must still clean up."""


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


class BlobStoreContract:
    #: Large enough to span three S3 parts when the backend's fixture uses 5 MiB parts.
    big_size = 12 * MiB + 12345

    @pytest.fixture
    def store(self) -> BlobStore:
        raise NotImplementedError("a backend's test class provides an empty store")

    def leftovers(self, store: BlobStore) -> list[str]:
        """Partial state left behind by interrupted writes; empty when all was cleaned up."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def big(cls) -> bytes:
        return os.urandom(cls.big_size)

    # -- put / get --------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "chunks",
        [
            [],
            [b""],
            [b"", b"abc", b"", b"", b"def", b""],
            [b"x" * 1000],
            [bytearray(b"byte"), memoryview(b"--view--")[2:6], b"bytes"],
            [memoryview(array.array("I", [1, 2, 3, 0xFFFFFFFF]))],
            [bytes([i]) for i in range(256)],
        ],
        ids=[
            "nothing",
            "one-empty",
            "empty-pieces",
            "one",
            "buffer-types",
            "non-byte-view",
            "tiny-pieces",
        ],
    )
    def test_roundtrip(self, store: BlobStore, chunks: list[bytes]) -> None:
        expected = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        assert store.put_stream("runs/r/blob", iter(chunks)) == len(expected)
        assert store.get("runs/r/blob") == expected
        assert store.exists("runs/r/blob")

    @pytest.mark.parametrize("piece_size", [MiB + 3, 7 * MiB, 64 * 1024])
    def test_multipart_roundtrip(self, store: BlobStore, big: bytes, piece_size: int) -> None:
        assert store.put_stream("runs/r/big", pieces(big, piece_size)) == len(big)
        assert store.get("runs/r/big") == big

    def test_producer_may_reuse_its_buffer(self, store: BlobStore, big: bytes) -> None:
        def produce() -> Iterator[memoryview]:
            buf = bytearray(MiB)
            for piece in pieces(big, MiB):
                buf[: len(piece)] = piece
                yield memoryview(buf)[: len(piece)]
                buf[:] = bytes(MiB)  # scribble over what was just handed out

        assert store.put_stream("k", produce()) == len(big)
        assert store.get("k") == big

    def test_one_huge_piece(self, store: BlobStore, big: bytes) -> None:
        assert store.put_stream("k", [memoryview(big)]) == len(big)
        assert store.get("k") == big

    def test_ranges(self, store: BlobStore) -> None:
        data = bytes(range(256)) * 4
        n = len(data)
        store.put_stream("k", [data])
        for start, end in [(0, 10), (100, 357), (n - 7, n), (0, n), (5, 5), (0, 0), (n, n)]:
            assert store.get("k", (start, end)) == data[start:end], (start, end)
            assert bytes(store.view("k", start, end)) == data[start:end], (start, end)

    def test_ranges_of_a_big_blob(self, store: BlobStore, big: bytes) -> None:
        store.put_stream("k", pieces(big, 3 * MiB))
        n = len(big)
        spans = [(0, 1), (5 * MiB - 1, 5 * MiB + 1), (1, n - 1), (n - 10, n), (3, 11 * MiB)]
        for start, end in spans:
            assert store.get("k", (start, end)) == big[start:end], (start, end)
            assert bytes(store.view("k", start, end)) == big[start:end], (start, end)

    def test_range_past_end(self, store: BlobStore) -> None:
        store.put_stream("k", [b"0123456789"])
        for bad in [(0, 11), (5, 11), (10, 11), (11, 11), (20, 30)]:
            with pytest.raises(ValueError):
                store.get("k", bad)
            with pytest.raises(ValueError):
                store.view("k", *bad)

    def test_invalid_range(self, store: BlobStore) -> None:
        store.put_stream("k", [b"0123456789"])
        for bad in [(-1, 3), (5, 4)]:
            with pytest.raises(ValueError):
                store.get("k", bad)

    def test_empty_blob(self, store: BlobStore) -> None:
        assert store.put_stream("k", []) == 0
        assert store.exists("k")
        assert store.get("k") == b""
        assert store.get("k", (0, 0)) == b""
        with pytest.raises(ValueError):
            store.get("k", (0, 1))

    def test_missing_key(self, store: BlobStore) -> None:
        assert not store.exists("runs/r/missing")
        for byte_range in [None, (0, 1), (0, 0), (5, 10)]:
            with pytest.raises(BlobNotFound):
                store.get("runs/r/missing", byte_range)
        with pytest.raises(BlobNotFound):
            store.view("runs/r/missing", 0, 1)

    def test_overwrite(self, store: BlobStore, big: bytes) -> None:
        store.put_stream("k", pieces(big, MiB))
        assert store.put_stream("k", [b"short"]) == 5
        assert store.get("k") == b"short"
        store.put_stream("k", pieces(big, MiB))
        assert store.get("k") == big
        assert list(store.iter_keys()) == ["k"]

    # -- delete / exists / list -------------------------------------------------------------

    def test_delete_is_idempotent(self, store: BlobStore) -> None:
        store.delete("never/written")
        store.put_stream("a/b", [b"x"])
        store.delete("a/b")
        assert not store.exists("a/b")
        with pytest.raises(BlobNotFound):
            store.get("a/b")
        store.delete("a/b")
        assert list(store.iter_keys()) == []

    def test_discard_deletes_like_delete(self, store: BlobStore) -> None:
        store.discard("never/written")
        store.put_stream("a/b", [b"x"])
        store.discard("a/b")
        assert not store.exists("a/b")
        with pytest.raises(ValueError):
            store.discard("../escape")

    def test_a_working_store_is_ready_and_leaves_nothing(self, store: BlobStore) -> None:
        store.check_ready()
        store.check_ready()
        assert list(store.iter_keys()) == []
        assert self.leftovers(store) == []

    def test_iter_keys(self, store: BlobStore) -> None:
        keys = ["runs/a/2", "runs/a/10", "runs/a-b/1", "runs/ab", "runs/a/sub/x", "other", "r"]
        for k in keys:
            store.put_stream(k, [k.encode()])
        assert list(store.iter_keys()) == sorted(keys)
        assert list(store.iter_keys("")) == sorted(keys)
        assert list(store.iter_keys("runs/a/")) == ["runs/a/10", "runs/a/2", "runs/a/sub/x"]
        assert list(store.iter_keys("runs/a")) == [
            "runs/a-b/1",
            "runs/a/10",
            "runs/a/2",
            "runs/a/sub/x",
            "runs/ab",
        ]
        assert list(store.iter_keys("runs/a/1")) == ["runs/a/10"]
        assert list(store.iter_keys("r")) == sorted(k for k in keys if k.startswith("r"))
        assert list(store.iter_keys("nothing/")) == []
        assert list(store.iter_keys("runs/a/sub/x")) == ["runs/a/sub/x"]

    @pytest.mark.parametrize("key", ["", "/abs", "../x", "a/../../x", "a//b", "a/./b", "a/"])
    def test_invalid_keys(self, store: BlobStore, key: str) -> None:
        with pytest.raises(ValueError):
            store.put_stream(key, [b"x"])
        with pytest.raises(ValueError):
            store.get(key)
        with pytest.raises(ValueError):
            store.exists(key)
        with pytest.raises(ValueError):
            store.delete(key)
        assert list(store.iter_keys()) == []

    # -- atomicity --------------------------------------------------------------------------

    def test_invisible_until_complete(self, store: BlobStore, big: bytes) -> None:
        seen = []

        def produce() -> Iterator[bytes]:
            for piece in pieces(big, 2 * MiB):
                yield piece
                seen.append(store.exists("k"))
                assert list(store.iter_keys()) == []
                with pytest.raises(BlobNotFound):
                    store.get("k", (0, 1))

        store.put_stream("k", produce())
        assert seen and not any(seen)
        assert store.get("k") == big

    def test_overwrite_keeps_old_until_complete(self, store: BlobStore, big: bytes) -> None:
        store.put_stream("k", [b"old"])

        def produce() -> Iterator[bytes]:
            for piece in pieces(big, 4 * MiB):
                yield piece
                assert store.get("k") == b"old"

        store.put_stream("k", produce())
        assert store.get("k") == big

    @pytest.mark.parametrize("fail_after", [0, 1, 5], ids=["at-once", "first-part", "late"])
    @pytest.mark.parametrize("exc_type", [Boom, OSError, Interrupted, GeneratorExit])
    def test_failed_put_leaves_nothing(
        self, store: BlobStore, big: bytes, fail_after: int, exc_type: type[BaseException]
    ) -> None:
        def produce() -> Iterator[bytes]:
            for i, piece in enumerate(pieces(big, 2 * MiB)):
                if i == fail_after:
                    raise exc_type("producer failed")
                yield piece

        with pytest.raises(exc_type, match="producer failed"):
            store.put_stream("k", produce())
        assert not store.exists("k")
        assert list(store.iter_keys()) == []
        assert self.leftovers(store) == []

    def test_failed_overwrite_keeps_old(self, store: BlobStore, big: bytes) -> None:
        store.put_stream("k", [b"old"])

        def produce() -> Iterator[bytes]:
            yield from pieces(big[: 11 * MiB], MiB)
            raise Boom("producer failed")

        with pytest.raises(Boom):
            store.put_stream("k", produce())
        assert store.get("k") == b"old"
        assert self.leftovers(store) == []

    # -- threads ----------------------------------------------------------------------------

    def test_concurrent_puts_and_gets(self, store: BlobStore) -> None:
        blobs = {
            f"runs/r{i}/blob": os.urandom(i * 1000 + (6 * MiB if i % 3 == 0 else 0))
            for i in range(8)
        }

        def put(item: tuple[str, bytes]) -> int:
            key, data = item
            return store.put_stream(key, pieces(data, 700_000))

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(put, blobs.items())) == [len(d) for d in blobs.values()]
            got = pool.map(store.get, list(blobs) * 2)
            assert list(got) == list(blobs.values()) * 2
        assert list(store.iter_keys()) == sorted(blobs)

    def test_readers_see_whole_versions_during_overwrites(self, store: BlobStore) -> None:
        versions = [bytes([v]) * (6 * MiB + 17) for v in range(4)]
        store.put_stream("k", [versions[0]])
        stop = threading.Event()
        bad: list[str] = []

        def read() -> None:
            while not stop.is_set():
                data = store.get("k")
                if data not in versions:
                    bad.append(f"torn read of {len(data)} bytes")
                if store.get("k", (6 * MiB, 6 * MiB + 17)) not in [v[:17] for v in versions]:
                    bad.append("torn range")

        readers = [threading.Thread(target=read) for _ in range(3)]
        for t in readers:
            t.start()
        try:
            for v in versions[1:]:
                store.put_stream("k", pieces(v, MiB))
        finally:
            stop.set()
            for t in readers:
                t.join()
        assert bad == []
        assert store.get("k") == versions[-1]
