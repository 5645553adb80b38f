"""--tensorboard DIR: the run's scalars, read back with TensorBoard's own reader (EventAccumulator).

Oracle: the run's --metrics-json (its losses and held-out losses), the flags (lr), and what every step
must have (a positive grad norm, step time and memory). Needs tensorboardX (the writer, the ``hf`` extra)
and tensorboard (the reader); skipped without them.
"""
import os

import numpy as np
import pytest

from tests.mpirun import one_line, run_mpi, run_train

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def scalars(folder):
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_read_back_with_tensorboard(tmp_path):
    """N=2, GPT, 4 steps, held-out loss every 2: each step's loss, lr, grad norm, loss scale, tokens/s, step time and
    its parts, memory; the held-out losses at steps 2 and 4; the values those of the metrics."""
    m = run_train(2, tmp_path, "--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "4",
                  "--steps", "4", "--eval-every", "2", "--stage", "3", "--lr", "0.002",
                  "--tensorboard", tmp_path / "tb")
    got = scalars(tmp_path / "tb")
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([v for _, v in got["train/loss"]], m["losses"], rtol=1e-6)
    np.testing.assert_allclose(got["train/held_out_loss"], np.array(m["val_losses"]), rtol=1e-6)
    assert [v for _, v in got["train/lr"]] == pytest.approx([0.002] * 4)
    assert all(v > 0 for _, v in got["train/grad_norm"]) and len(got["train/loss_scale"]) == 4
    for tag in ("train/tokens_per_s", "time/step_ms", "time/forward_ms", "time/backward_ms", "memory/optimizer_bytes",
                "memory/engine_peak_bytes", "memory/max_rss_bytes"):
        assert len(got[tag]) == 4 and all(v > 0 for _, v in got[tag]), tag
    assert len(os.listdir(tmp_path / "tb")) == 1          # rank 0's one event file


def test_tensorboard_folder_that_cannot_be_one(tmp_path):
    """A file where the folder should be: one line, exit 2."""
    (tmp_path / "f").write_text("x")
    proc = run_mpi(2, ["-m", "zerompi.train", "--steps", "1", "--tensorboard", tmp_path / "f"], check=False)
    one_line(proc, 2, "tensorboard=", "is a file, not a folder")
