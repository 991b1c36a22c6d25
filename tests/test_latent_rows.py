"""LatentRows: overlapping and late chunks, take_new ranges (pure tensor code, no vLLM)."""

import pytest
import torch

from omni_cache.cache.latent_rows import LatentBuffer, LatentChunk, LatentRows


def chunk(start: int, n: int) -> LatentChunk:
    # Row value = position, so any misplaced row is visible.
    pos = torch.arange(start, start + n, dtype=torch.float32)
    return LatentChunk(start, {"hidden": pos[:, None].repeat(1, 4), "tap": -pos[:, None]})


def positions(rows: dict[str, torch.Tensor]) -> list[int]:
    assert rows["hidden"].shape[0] == rows["tap"].shape[0]
    assert torch.equal(rows["tap"][:, 0], -rows["hidden"][:, 0])
    return rows["hidden"][:, 0].int().tolist()


def test_take_new_hands_out_each_position_once_across_chunks():
    rows = LatentRows(("hidden", "tap"))
    rows.add(chunk(0, 5))
    assert positions(rows.take_new(upto=3)[1]) == [0, 1, 2]
    rows.add(chunk(5, 1))
    rows.add(chunk(6, 2))
    start, new = rows.take_new()
    assert start == 3 and positions(new) == [3, 4, 5, 6, 7]
    assert rows.take_new() == (8, {})
    rows.add(chunk(8, 1))
    assert positions(rows.take_new(upto=100)[1]) == [8]
    assert positions(rows.all()) == list(range(9))


def test_overlapping_and_stale_chunks_keep_the_first_copy():
    rows = LatentRows(("hidden", "tap"))
    rows.add(chunk(0, 4))
    stale = chunk(2, 4)
    stale.tensors = {n: t + 1000 for n, t in stale.tensors.items()}  # must not win for 2, 3
    rows.add(stale)
    rows.add(chunk(1, 2))  # entirely old: ignored
    got = rows.all()["hidden"][:, 0].int().tolist()
    assert got == [0, 1, 2, 3, 1004, 1005]


def test_gap_raises():
    rows = LatentRows(("hidden", "tap"))
    rows.add(chunk(0, 2))
    with pytest.raises(RuntimeError, match="rows 2..3 are missing"):
        rows.add(chunk(4, 1))


# ---- LatentBuffer: the receiving side ------------------------------------------------------------


def test_buffer_views_grow_without_recopying():
    buf = LatentBuffer(("hidden", "tap"))
    storages, views = set(), []
    for pos in range(1000):  # one row per message, as a decoding upstream sends them
        buf.add(chunk(pos, 1))
        view = buf.view()
        storages.add(view["hidden"].untyped_storage().data_ptr())
        views.append(view)
    assert positions(buf.view()) == list(range(1000))
    # Capacity doubles: a handful of re-allocations (each copying what is held once), not one
    # copy of everything per message.
    assert len(storages) <= 8, len(storages)
    # Views handed out earlier still show their rows (rows are never written twice).
    assert positions(views[10]) == list(range(11))


def test_buffer_overlap_gap_and_foreign_rows():
    buf = LatentBuffer(("hidden", "tap"), max_rows=10)
    buf.add(chunk(0, 4))
    stale = chunk(2, 4)
    stale.tensors = {n: t + 1000 for n, t in stale.tensors.items()}
    buf.add(stale)
    assert buf.view()["hidden"][:, 0].int().tolist() == [0, 1, 2, 3, 1004, 1005]
    with pytest.raises(RuntimeError, match="rows 6..7 are missing"):
        buf.add(chunk(8, 1))
    with pytest.raises(ValueError, match="expected"):
        buf.add(LatentChunk(6, {"hidden": torch.zeros(1, 4)}))
    with pytest.raises(ValueError, match="earlier rows were"):
        buf.add(LatentChunk(6, {"hidden": torch.zeros(1, 5), "tap": torch.zeros(1, 1)}))
    with pytest.raises(ValueError, match="limit of 10"):
        buf.add(chunk(6, 5))
    assert buf.num_rows == 6
