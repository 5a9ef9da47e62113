"""A retraction undoes the step it interrupts once: a request retracted again right after it
resumed (before its next step) keeps the statistics and row its resume gave it."""

import torch

from sgl_vtoken.config import EvictConfig
from sgl_vtoken.patches.runtime import new_state
from sgl_vtoken.patches.step.retraction import undo_step


def test_a_second_retraction_before_the_next_step_undoes_nothing():
    st = new_state(EvictConfig(policy="h2o", budget=8, sink=2, window=2), "r0", holed=True)
    before = torch.arange(5, dtype=torch.float32)[:, None, None]
    st.stats.accumulator.state = before
    st.retract.start_step(st.stats.snapshot())  # the step starts: 5 entries
    st.stats.accumulator.state = torch.ones(7, 1, 1)  # folded and evicted in it
    slots, positions = torch.arange(7), torch.arange(7)
    st.retract.save_undo(slots, positions, st.row, st.report)
    assert undo_step(st) is not None  # first retraction: back to 5
    assert torch.equal(st.stats.accumulator.state, before)
    resumed = torch.full((5, 1, 1), 2.0)  # the resume's own statistics
    st.stats.accumulator.state = resumed
    assert undo_step(st) is None  # retracted again: nothing to undo
    assert st.stats.accumulator.state is resumed
