"""The GRPO example (examples/arithmetic_grpo.py, docs/language-models.md#an-example-that-learns-sums) as the docs run
it: the model fine-tuned on sums answered wrong more often than right answers most held-out sums wrong; GRPO with the
reward that checks the answer, on the other sums, makes it answer most of the held-out ones right. The run's own
evaluation (greedy, each held-out prompt once) is what transformers' generate gives on its run folder."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, one_thread, reset_accelerate

pytest.importorskip("transformers")


def test_grpo_makes_the_held_out_sums_right(tmp_path):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import arithmetic_grpo
    finally:
        sys.path.remove(str(REPO / "examples"))
    reset_accelerate()
    with one_thread():
        figures = arithmetic_grpo.main([str(tmp_path / "arithmetic")])
    reset_accelerate()
    assert figures["held_out_right_before"] <= 0.4, figures
    assert figures["held_out_right_after"] >= figures["held_out_right_before"] + 0.3, figures
    assert figures["grpo_eval_reward"] == pytest.approx(figures["held_out_right_after"])
    completions = (tmp_path / "arithmetic" / "grpo" / "completions.jsonl").read_text().splitlines()
    assert len(completions) == 4 * 64  # steps 10, 20, 30 and 40: the step's 64 completions each
