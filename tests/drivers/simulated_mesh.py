"""One pipelined rank's memory and traffic, real and simulated, over the same cases (tests/test_simulated_mesh.py).

``mpiexec -n 4 python simulated_mesh.py``: a real 4-rank job per case; rank 0 prints one JSON line, every
rank's report per case. ``python simulated_mesh.py R``: one process as rank R of 4 (comm/simulated_world.py), the
same cases; it prints one JSON line, its report per case. A report is what the rank measured after two
steps: each of its chunks' model states and peak buffers, the activations its chunk runners held, the
calls and bytes of every ZeRO collective (by level, and unquantized), of every kind of pipeline message
(to peers on this node and on others) and of the TP all-reduces. Overlap is off, so the buffers a real
run holds do not depend on its timing.
"""
from zerompi.comm.communicator import as_communicator
from zerompi.train.config import parse_config
from zerompi.train.models.chunks import pools_peak_bytes
from zerompi.train.pipeline import PipelineJob
from zerompi.train.run import build_model

N = 4
GPT = ["--n-layer", "4", "--d-model", "32", "--n-head", "2", "--seq-len", "16"]
CASES = {
    "1f1b-stage1": GPT + ["--pp", "2", "--stage", "1"],
    "1f1b-stage2-offload-cpu": GPT + ["--pp", "2", "--stage", "2", "--offload-optimizer", "cpu"],
    "zb-h1-stage3-gather-per-step": GPT + ["--pp", "2", "--stage", "3", "--schedule", "zb-h1", "--pp-gather", "step"],
    "interleaved-stage2-nodes-bf16": GPT + ["--pp", "2", "--stage", "2", "--schedule", "interleaved", "--chunks", "2",
                                            "--node-size", "2", "--dtype", "bf16"],
    "stage3-nodes-hpz-qwz-qgz": GPT + ["--pp", "2", "--stage", "3", "--node-size", "1", "--hpz", "--quantize-weights",
                                       "int8", "--quantize-grads", "int8"],
    "pp4-stage0": GPT + ["--pp", "4", "--stage", "0", "--micro-batches", "4"],
    "gpipe-tp2-stage3": GPT + ["--pp", "2", "--tp", "2", "--stage", "3", "--schedule", "gpipe"],
    "zb-h1-sp2-stage2": GPT + ["--pp", "2", "--sp", "2", "--stage", "2", "--schedule", "zb-h1"],
    "mlp-stage2-reduce-per-step": ["--model", "mlp", "--width", "32", "--depth", "4", "--pp", "2", "--stage", "2",
                                   "--pp-grad-reduce", "step"],
}


def run(world, flags) -> dict:
    cfg = parse_config(["--batch", "8", "--micro-batches", "2", "--no-overlap", "--bucket-mb", "0.01", *flags])
    comm = as_communicator(world, 60)
    cfg.check_world(comm.size)
    job = PipelineJob(cfg, comm, build_model)
    for step in range(2):
        _, losses, _ = job.step_once(step)
        job.reduce_loss(losses)
    mesh = job.mesh
    out = {"chunks": {str(c): [e.memory_report()["measured"], e.memory_report()["peak_buffers"]["bytes"]]
                      for c, e in job.engines.engines.items()},
           "activations": pools_peak_bytes([r.pool for r in job.runners.values() if getattr(r, "pool", None)]),
           "zero": {op: [s.calls, s.bytes, s.intra, s.inter, s.logical] for op, s in sorted(comm.stats.items())},
           "pp": {k: [s.calls, s.bytes, s.intra, s.inter] for k, s in sorted(mesh.pp_comm.stats.items()) if s.calls},
           "tp": mesh.tp_comm.bytes_sent(), "sp": mesh.sp_comm.bytes_sent()}
    job.close()
    return out


if __name__ == "__main__":
    from simulated import main        # this folder's driver: the same real / simulated launch
    main(run, CASES, N)
