"""GPT-2 under PyTorch DDP or FSDP2 on N CPU processes (gloo), beside ``zerompi.train`` at the same shapes.

    python scripts/bench_torch_dist_gpt.py --mode fsdp2 --ranks 4 --data tokens.bin --steps 3 \
        --n-layer 12 --d-model 768 --n-head 12 --seq-len 1024 --vocab 50257 --batch 4

The model is transformers' GPT2LMHeadModel (random weights, no dropout): the same model as zerompi's GPT
(tests/test_hf_transformers.py compares their logits). Each rank trains on its rows of the global batch
(windows of the token file at random offsets), one thread per rank as zerompi's ranks use one BLAS thread;
fp32 parameters and AdamW. Prints, as JSON: each step's time and tokens/s over the job, and each rank's peak
resident memory (ru_maxrss). ``--mode ddp``: whole replicas, gradients all-reduced; ``fsdp2``:
torch.distributed.fsdp.fully_shard on every block and the root (parameters, gradients and optimizer state
sharded: ZeRO-3). docs/interop.md has the numbers measured here.
"""
import argparse
import json
import os
import resource
import time

import numpy as np


def worker(rank: int, a) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=a.vocab, n_positions=a.seq_len, n_embd=a.d_model, n_layer=a.n_layer,
                                     n_head=a.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    if a.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids = np.memmap(a.data, np.uint16, "r")
    per = a.batch // a.ranks
    times = []
    for step in range(a.steps):
        rng = np.random.default_rng([step, rank])
        starts = rng.integers(0, len(ids) - a.seq_len - 1, per)
        rows = torch.tensor(np.stack([ids[s:s + a.seq_len + 1] for s in starts]).astype(np.int64))
        dist.barrier()
        t0 = time.perf_counter()
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
        print(json.dumps({"mode": a.mode, "ranks": a.ranks, "step_s": times,
                          "tokens_per_s": [a.batch * a.seq_len / t for t in times],
                          "max_rss_bytes": [int(r) for r in every]}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "fsdp2"), default="fsdp2")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--data", required=True, help="a uint16 token file (python -m zerompi.data prepare)")
    p.add_argument("--steps", type=int, default=3)
    for name, default in (("n-layer", 12), ("d-model", 768), ("n-head", 12), ("seq-len", 1024), ("vocab", 50257),
                          ("batch", 4), ("port", 29517)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(a,), nprocs=a.ranks)


if __name__ == "__main__":
    main()
