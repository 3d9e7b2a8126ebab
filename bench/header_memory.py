"""Peak memory of reading one save's header: a header announcing ``--tensors`` empty tensors
(1,000,000: about 78 MB, under the 100 MiB header limit) through the service's
``open_body`` with the default limits (200,000 tensors), in a fresh process. Prints the
header's size, the outcome (413 expected) and the process's peak RSS above its start.

    python bench/header_memory.py [--tensors 1000000]
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def header_body(n: int) -> bytes:
    """A framed safetensors header of ``n`` empty tensors named like a real model's."""
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    text = json.dumps({f"model.layers.{i}.mlp.weight": empty for i in range(n)}).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def rss(field: str) -> int:
    """This process's ``VmRSS`` or ``VmHWM`` (its peak since the last reset), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0]) << 10


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def pieces(path: Path) -> Iterator[bytes]:
    """The body in 1 MiB pieces, as the service receives it."""
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            yield piece


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tensors", type=int, default=1_000_000)
    ap.add_argument("--body", type=Path, help=argparse.SUPPRESS)  # the measuring child's
    args = ap.parse_args()
    if args.body is None:  # make the body here, measure in a fresh process
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "body"
            body.write_bytes(header_body(args.tensors))
            child = [sys.executable, __file__, "--tensors", str(args.tensors), "--body", str(body)]
            subprocess.run(child, check=True)
        return

    from ckptstore_core.errors import CkptStoreError
    from ckptstore_service.save.header import open_body
    from ckptstore_service.settings import Settings

    settings = Settings()
    reset_peak()
    before = rss("VmRSS")
    started = time.perf_counter()
    try:
        incoming = open_body(pieces(args.body), None, settings)
        outcome = f"accepted ({len(incoming.header.tensors)} tensors)"
    except CkptStoreError as exc:
        outcome = f"{exc.status} {exc.code}"
    took = time.perf_counter() - started
    size = args.body.stat().st_size
    grew = rss("VmHWM") - before
    print(
        f"{args.tensors} tensors, header {size / 1e6:.1f} MB: {outcome} in {took:.2f} s, "
        f"peak RSS +{grew / 1e6:.0f} MB ({grew / size:.1f}x the header)"
    )


if __name__ == "__main__":
    main()
