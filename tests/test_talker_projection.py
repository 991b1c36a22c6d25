"""The talker projection's memo gives bitwise what projecting every row gives, and reuses only whole
blocks of bitwise equal rows (issue 51: a session's every request projects its user turns so far).

The oracle is the projection itself, run block by block on all rows with nothing remembered.
"""

from __future__ import annotations

import pytest
import torch

from omni_cache.models.talker_projection import PROJECTION_BLOCK, Projection, ProjectionMemo

B = PROJECTION_BLOCK


def projection(dtype: torch.dtype = torch.float32, dim: int = 48, out: int = 24) -> Projection:
    g = torch.Generator().manual_seed(3)
    shapes = [(dim, dim), (dim,), (out, dim), (out,)]
    return Projection(*(torch.randn(*shape, generator=g).to(dtype) for shape in shapes))


def rows(n: int, dtype: torch.dtype = torch.float32, seed: int = 0, dim: int = 48) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_growing_session_reuses_its_whole_blocks_and_equals_a_fresh_projection(dtype):
    proj = projection(dtype)
    memo = ProjectionMemo(proj)
    turn = rows(5 * B + 7, dtype)  # the session's rows so far: grows by 37 rows a request
    reused = 0
    for n in (37, 74, 111, 148, 5 * B + 7):
        got = memo(turn[:n])
        assert torch.equal(bits(got), bits(proj.blockwise(turn[:n])))
        # Every whole block of the call before is reused; nothing of its partial block.
        assert memo.rows_reused - reused == (0 if n == 37 else (n - 37) // B * B)
        reused = memo.rows_reused
    assert len(memo) == 1  # each call took the place of the one it extended


def test_a_changed_row_is_projected_again_from_its_block_on():
    proj = projection()
    memo = ProjectionMemo(proj)
    first = rows(6 * B)
    memo(first)
    second = first.clone()
    second[3 * B + 5, 7] += 1.0  # block 3 differs
    got = memo(second)
    assert torch.equal(got, proj.blockwise(second))
    assert memo.rows_reused == 3 * B
    # A negative zero is a different row (its products' signs may differ): not reused either.
    third = first.clone()
    third[B + 2, 0] = 0.0
    memo(third)
    fourth = third.clone()
    fourth[B + 2, 0] = -0.0
    before = memo.rows_reused
    assert torch.equal(bits(memo(fourth)), bits(proj.blockwise(fourth)))
    assert memo.rows_reused - before == B


def test_two_sessions_keep_their_own_entries_and_the_memo_is_bounded():
    proj = projection()
    memo = ProjectionMemo(proj, max_rows=10 * B, max_entries=3)
    a, b = rows(4 * B, seed=1), rows(4 * B, seed=2)
    memo(a[: 2 * B])
    memo(b[: 2 * B])
    assert torch.equal(memo(a), proj.blockwise(a))
    assert torch.equal(memo(b), proj.blockwise(b))
    assert memo.rows_reused == 4 * B
    for seed in range(3, 6):
        memo(rows(3 * B, seed=seed))
    assert len(memo) <= 3 and memo.held_rows <= 10 * B
    # More rows than the memo holds are projected and not kept.
    held = memo.held_rows
    memo(rows(11 * B, seed=9))
    assert memo.held_rows == held
