"""How the hidden-cache tests decide which rows two engines must agree on (thinker_harness).

Row i is the model's output for input token i, so after the first generated token that differs
between the cache-on and cache-off engine, the engines were fed different inputs. Rows are compared
up to and including the row that sampled that token, and the divergence must be a near-tie.
"""

from __future__ import annotations

import pytest
import torch
from thinker_harness import Result, comparable_rows

PROMPT = 5


def result(tokens: list[int], logprobs: list[dict[int, float]]) -> Result:
    rows = PROMPT + len(tokens) - 1
    return Result(
        token_ids=tokens,
        num_prompt_tokens=PROMPT,
        logprobs=logprobs,
        chunks=[(0, {"hidden": torch.zeros(rows, 2), "layer_2": torch.zeros(rows, 2)})],
    )


def test_same_tokens_compare_every_row():
    lp = [{1: -0.1, 2: -3.0}] * 3
    assert comparable_rows(result([1, 1, 1], lp), result([1, 1, 1], lp), "x", 1e-3) == PROMPT + 2


def test_near_tie_stops_after_the_row_that_sampled_it():
    on = result([1, 7, 9], [{1: -0.1, 2: -3.0}, {7: -0.6931, 8: -0.6932}, {9: -0.1, 3: -4.0}])
    off = result([1, 8, 4], [{1: -0.1, 2: -3.0}, {8: -0.6931, 7: -0.6935}, {4: -0.1, 5: -4.0}])
    # Token 1 differs; it was sampled from row PROMPT (the row fed token 0), which is compared.
    assert comparable_rows(on, off, "x", 1e-3) == PROMPT + 1


def test_a_clear_winner_that_differs_is_not_a_tie():
    on = result([1, 7], [{1: -0.1, 2: -3.0}, {7: -0.1, 8: -2.5}])
    off = result([1, 8], [{1: -0.1, 2: -3.0}, {8: -0.1, 7: -2.5}])
    with pytest.raises(AssertionError, match="not a near-tie"):
        comparable_rows(on, off, "x", 1e-3)


def test_other_token_outside_the_top_two_is_not_a_tie():
    on = result([7], [{7: -0.1, 3: -2.0}])
    off = result([8], [{8: -0.1, 5: -2.0}])
    with pytest.raises(AssertionError, match="not even in the top 2"):
        comparable_rows(on, off, "x", 1e-3)
