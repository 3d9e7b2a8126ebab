"""How much the codec work of one save, load or re-root may hold at once: computed here
only, from the settings and the codec pool's size."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Budget"]


@dataclass(frozen=True, slots=True)
class Budget:
    workers: int  # codec threads
    chunk_bytes: int  # the chunk size (settings.chunk_bytes)

    @property
    def in_flight(self) -> int:
        """Chunks a save or a load keeps queued in the codec pool: enough to keep every
        worker busy, few enough to bound memory."""
        return 2 * self.workers + 2

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of raw chunks queued ahead: a load's decoded chunks waiting to be sent, a
        save's small chunks waiting to be written, a re-root's chains being re-encoded."""
        return self.in_flight * self.chunk_bytes
