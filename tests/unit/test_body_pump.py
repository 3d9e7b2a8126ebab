"""``api.body.pump``, which moves an upload's body from the event loop to its ingest thread:
what the client sent reaches that thread even when nothing follows it."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import anyio

from ckptstore_service.api.body import BodyPipe, pump


def test_a_header_and_first_bytes_reach_a_late_consumer_though_the_body_then_stalls() -> None:
    """A client sends its header, then its first tensor bytes, then nothing for a while; both
    arrive before the ingest thread has taken the first. The thread must still get both:
    a writer takes its run's lock once the first tensor bytes are in (the pump once held a
    piece back until the consumer was idle, so a rank paused mid-part held no lock)."""
    sent = [b"header", b"first tensor bytes"]

    async def main() -> list[bytes]:
        pipe = BodyPipe()
        stalled = anyio.Event()

        async def body() -> AsyncIterator[bytes]:
            for piece in sent:
                yield piece
            stalled.set()  # the pump asked for more: everything sent is in its hands
            await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, body(), pipe)
            await stalled.wait()
            with anyio.fail_after(10):
                got = await anyio.to_thread.run_sync(
                    lambda: [bytes(p) for p in itertools.islice(iter(pipe), len(sent))],
                    abandon_on_cancel=True,
                )
            tg.cancel_scope.cancel()
        return got

    assert anyio.run(main) == sent
