"""GPT-2 under PyTorch DDP or FSDP2 on N CPU processes (gloo), beside ``zerompi.train`` at the same shapes.

    python scripts/bench_torch_dist_gpt.py --mode fsdp2 --ranks 4 --data tokens.bin --steps 3 \
        --n-layer 12 --d-model 768 --n-head 12 --seq-len 1024 --vocab 50257 --batch 4
    python scripts/bench_torch_dist_gpt.py --model builtin --mode ddp --ranks 2 --steps 6 \
        --n-layer 6 --d-model 256 --n-head 4 --seq-len 128 --vocab 32 --batch 16

``--model gpt2`` (default): transformers' GPT2LMHeadModel (random weights, no dropout), the same model as
zerompi's GPT (tests/test_hf_transformers.py compares their logits), on windows of ``--data`` (a token
file) at random offsets. ``--model builtin``: zerompi's GPT written in torch modules (scripts/torch_gpt.py,
whose loss and gradients bench_torch_gpt.py checks against zerompi's; GPT-2 style random values of the same
shapes), on random token ids (no file needed, no transformers): the PyTorch side of the performance
table's rows ``gpt_n2_vs_torch_ddp`` and ``gpt_n4_vs_torch_fsdp2`` (scripts/bench_suite.py). Each rank
trains on its rows of the global batch, one thread per rank as zerompi's ranks use one BLAS thread; fp32
parameters and AdamW; each step is timed between barriers (the slowest rank). Prints, as JSON: each step's
time and tokens/s over the job, and each rank's peak resident memory (ru_maxrss). ``--mode ddp``: whole
replicas, gradients all-reduced; ``fsdp2``:
torch.distributed.fsdp.fully_shard on every block and the root (parameters, gradients and optimizer state
sharded: ZeRO-3). docs/interop.md has the numbers measured here.
"""
import argparse
import json
import os
import resource
import time

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))    # scripts/torch_gpt.py


def worker(rank: int, a) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if a.model == "builtin":
        from torch_gpt import TorchGPT, random_layers
        model = TorchGPT(random_layers(a.vocab, a.seq_len, a.n_layer, a.d_model), a.n_head)
        blocks = model.blocks
    else:
        import transformers
        config = transformers.GPT2Config(vocab_size=a.vocab, n_positions=a.seq_len, n_embd=a.d_model,
                                         n_layer=a.n_layer, n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        blocks = model.transformer.h
    if a.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids = np.memmap(a.data, np.uint16, "r") if a.data else None
    per = a.batch // a.ranks
    times = []
    for step in range(a.steps):
        rng = np.random.default_rng([step, rank])
        if ids is None:
            rows = torch.tensor(rng.integers(0, a.vocab, (per, a.seq_len + 1)), dtype=torch.int64)
        else:
            starts = rng.integers(0, len(ids) - a.seq_len - 1, per)
            rows = torch.tensor(np.stack([ids[s:s + a.seq_len + 1] for s in starts]).astype(np.int64))
        dist.barrier()
        t0 = time.perf_counter()
        if a.model == "builtin":
            loss = model(rows[:, :-1], rows[:, 1:])
        else:
            logits = model(rows[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), rows[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], dtype=torch.int64)
    every = [torch.zeros_like(rss) for _ in range(a.ranks)]
    dist.all_gather(every, rss)
    if rank == 0:
        print(json.dumps({"model": a.model, "mode": a.mode, "ranks": a.ranks, "step_s": times,
                          "tokens_per_s": [a.batch * a.seq_len / t for t in times],
                          "max_rss_bytes": [int(r) for r in every]}))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)     # the measurement is out: skip PyTorch's C++ teardown, which aborted a rank (SIGABRT,
    #                 "terminate called without an active exception") in about one run of ten here


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt2", "builtin"), default="gpt2",
                   help="transformers' GPT-2, or zerompi's GPT in torch modules (scripts/torch_gpt.py)")
    p.add_argument("--mode", choices=("ddp", "fsdp2"), default="fsdp2")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--data", help="a uint16 token file (python -m zerompi.data prepare); --model gpt2 needs one, "
                                  "builtin uses random ids without it")
    p.add_argument("--steps", type=int, default=3)
    for name, default in (("n-layer", 12), ("d-model", 768), ("n-head", 12), ("seq-len", 1024), ("vocab", 50257),
                          ("batch", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--port", type=int, default=0, help="the rendezvous port (0: a free one)")
    a = p.parse_args()
    if a.model == "gpt2" and not a.data:
        p.error("--model gpt2 needs --data (a uint16 token file)")
    if a.ranks < 1 or a.batch % a.ranks or a.steps < 1:
        p.error(f"--batch {a.batch} must split evenly over --ranks {a.ranks} (>= 1), and --steps {a.steps} >= 1")
    if a.port == 0:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            a.port = s.getsockname()[1]
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(a,), nprocs=a.ranks)


if __name__ == "__main__":
    main()
