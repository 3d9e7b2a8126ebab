"""The catalog's parts protocol on both databases: a part that finishes after its
checkpoint was committed without it must not join the visible checkpoint."""

from __future__ import annotations

import pytest

from ckptstore_core.errors import CheckpointExists
from ckptstore_service.catalog import Catalog
from support.parts import finish_part_rows


def test_a_part_finishing_after_the_commit_is_refused(catalog: Catalog) -> None:
    run_id = catalog.ensure_run("r")
    checkpoint_id = catalog.open_parts(run_id, 1)
    catalog.begin_part(checkpoint_id, "a", "runs/r/1-a.blob")
    catalog.begin_part(checkpoint_id, "late", "runs/r/1-late.blob")
    finish_part_rows(catalog, checkpoint_id, "a")
    unnamed = catalog.commit_parts(
        "r", 1, ["a"], parent_id=None, keyframe=True, since_keyframe=0, metadata={}
    )
    assert unnamed == []  # "late" is still being written: its writer and the sweep own it
    with pytest.raises(CheckpointExists):
        finish_part_rows(catalog, checkpoint_id, "late")
    info = catalog.get("r", 1)
    assert [t.name for t in catalog.tensors(info.id)] == ["a.w"]
    assert info.tensors == 1 and info.parts == 1
    assert [p.name for p, _, _ in catalog.parts_in_progress()] == ["late"]
