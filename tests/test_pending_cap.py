"""Gradient reductions in flight are capped, so stages 2/3 never hold the whole local gradient."""
import numpy as np
import pytest

from tests.test_overlap import make_engine
from zerompi.engine.reducer import MAX_PENDING_REDUCES


@pytest.mark.parametrize("stage", [2, 3])
def test_reductions_in_flight_are_capped(stage):
    eng, _ = make_engine(stage, latency=10_000)  # collectives complete only when waited on
    pending, staged = [], []
    for i in reversed(range(eng.layout.num_layers)):
        with eng.unsharded(i):
            pass
        eng.grads_ready(i, {f"w{i}": np.ones((4, 4), np.float32)})
        pending.append(len(eng.reducer.handles))
        staged.append(len(eng.reducer.staging))
    assert max(pending) == MAX_PENDING_REDUCES < eng.layout.num_layers
    assert max(staged) <= MAX_PENDING_REDUCES
    assert not eng.step().skipped
    eng.close()
