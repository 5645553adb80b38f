"""A pipelined train run in which world rank 1 (the last stage) fails at step 2, for tests/test_pipeline_cli.py:
``raise`` (an exception in its backward) or ``hang`` (it sleeps there: stage 0 waits for the gradient)."""
import sys
import time

from mpi4py import MPI

from zerompi.train.models import gpt_chunk
from zerompi.train.run import main

KIND = sys.argv[1]
if MPI.COMM_WORLD.Get_rank() == 1:
    backward = gpt_chunk.GPTChunk.backward
    calls = [0]

    def failing(self, mb, dy, weights):
        calls[0] += 1
        if calls[0] == 5:                      # step 2's first backward (4 micro-batches a step)
            if KIND == "raise":
                raise RuntimeError("injected failure on the last stage")
            time.sleep(600)
        return backward(self, mb, dy, weights)
    gpt_chunk.GPTChunk.backward = failing
sys.exit(main(sys.argv[2:]))
