"""Maintenance: the work on committed checkpoints that no request waits for.

* :mod:`.reroot`: re-rooting a run's chain, so that its newest checkpoints stay shallow.
* :mod:`.delete`: deleting a checkpoint (re-basing what rests on it) or a run.
* :mod:`.rewrite`: rewriting committed chunks in place, what re-roots and deletes share.
* :mod:`.garbage`: deleting the blobs nothing needs any more (replaced by a re-root, or
  left by a crashed upload).
* :mod:`.scheduler`: :class:`Maintenance`, the background thread that runs both.
"""

from __future__ import annotations

from ckptstore_service.maintenance.garbage import (
    collect_crashed_uploads,
    collect_garbage,
    delete_blob,
)
from ckptstore_service.maintenance.reroot import (
    Rerooted,
    RerootPolicy,
    Stopped,
    reroot,
    reroot_pool,
    reroot_target,
)
from ckptstore_service.maintenance.scheduler import Maintenance

__all__ = [
    "Maintenance",
    "RerootPolicy",
    "Rerooted",
    "Stopped",
    "collect_crashed_uploads",
    "collect_garbage",
    "delete_blob",
    "reroot",
    "reroot_pool",
    "reroot_target",
]
