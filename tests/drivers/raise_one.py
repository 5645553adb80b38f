"""One rank raises an error of class CLASS in the middle of a train CLI job (tests/test_one_rank_errors.py):
CLASS RANK [FLAGS...]. The job must end within seconds with that rank's line, whatever the class, never
wait for the collective watchdog. ZEROMPI_TEST_AGREEMENT_S shortens how long a rank that caught an error
the CLI believes every rank raises waits for the others to report theirs (errors.ERROR_AGREEMENT_S)."""
import os
import sys

from mpi4py import MPI

from zerompi import errors
from zerompi.checkpoint.format import CheckpointError
from zerompi.engine.offload import OffloadError
from zerompi.train import job, run

CLASSES = {"JobError": errors.JobError, "MismatchError": errors.MismatchError, "NonFiniteError": errors.NonFiniteError,
           "AgreedConfigError": errors.AgreedConfigError, "OffloadError": OffloadError,
           "CheckpointError": CheckpointError, "ConfigError": errors.ConfigError, "UsageError": errors.UsageError,
           "RuntimeError": RuntimeError}
kind, who, flags = CLASSES[sys.argv[1]], int(sys.argv[2]), sys.argv[3:]
if "ZEROMPI_TEST_AGREEMENT_S" in os.environ:
    errors.ERROR_AGREEMENT_S = float(os.environ["ZEROMPI_TEST_AGREEMENT_S"])
losses_of = job.step_losses


def step_losses(model):
    real = losses_of(model)

    def losses(engine, net, data, step, *rest):
        if step == 1 and MPI.COMM_WORLD.Get_rank() == who:
            raise kind(f"raise_one: {kind.__name__} on rank {who} at step {step + 1}")
        return real(engine, net, data, step, *rest)
    return losses


job.step_losses = step_losses
sys.exit(run.main(flags))
