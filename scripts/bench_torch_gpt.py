"""The built-in GPT's training step under PyTorch beside zerompi's, on one device (JSON to stdout).

    python scripts/bench_torch_gpt.py                            # CPU, the default GPT
    python scripts/bench_torch_gpt.py --device gpu --models gpt-default,gpt-6x256 --json out.json

The same model in both: PyTorch's parameters (scripts/torch_gpt.py) are copied from zerompi's
GPT.init_layers() (pre-LayerNorm blocks, causal attention, tanh GELU, the head tied to the token table), and
before anything is timed the script checks that the two compute the same thing: on one
batch, PyTorch's fp32 loss and every gradient against zerompi's NumPy float64 forward and
backward (``parity``: the loss within 1e-5 relative, each gradient within 2e-5 of its largest
entry). A mismatch exits 1: a speed comparison of two different models would be meaningless.

Then, interleaved ``--repeats`` times after a warm-up, one training step (forward, backward,
AdamW) of the global batch, one process:

- ``torch_fp32``: fp32 parameters, ``F.scaled_dot_product_attention`` (flash / memory-efficient
  kernels on a GPU), AdamW with ``fused=True`` on a GPU;
- ``torch_bf16``: the same under ``torch.autocast(bfloat16)`` (fp32 master weights);
- ``zerompi_fp32`` / ``zerompi_bf16``: zerompi's engine at N = 1, stage 0, ``--dtype fp32`` /
  ``bf16`` (bf16 on a GPU needs CuPy 14; where it cannot run, the reason is recorded).

Each step is timed to the end of the device's work (synchronized). Medians, and each
zerompi / PyTorch ratio taken within one repeat, then the median. Needs PyTorch (CPU or
CUDA build) beside zerompi; without it, one line and exit 2.
"""
import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_floor import MODELS, placed  # noqa: E402  (the same model names and shapes as the GEMM-floor table)

LOSS_RTOL, GRAD_TOL = 1e-5, 2e-5   # fp32 against float64: measured 9e-8 and 1.6e-6 here; a GELU without tanh: 5e-5


def parity(torch, model, layers, idx, targets, device) -> dict:
    """PyTorch's fp32 loss and gradients against zerompi's float64 ones on the same batch."""
    ref = model.__class__(model.vocab, model.seq_len, model.n_layer, model.n_head, model.d_model, model.seed,
                          dtype=np.float64, kernels="numpy")
    ref_loss, ref_grads = ref.loss_and_grads([(n, {k: v.astype(np.float64) for k, v in p.items()}) for n, p in layers],
                                             idx, targets)
    from torch_gpt import TorchGPT     # zerompi's GPT in torch modules (imports torch)
    tm = TorchGPT(layers, model.n_head, device)
    loss = tm.loss(torch.tensor(idx, device=device), torch.tensor(targets, device=device))
    loss.backward()
    worst = 0.0
    for name, g in ref_grads.items():
        mine = tm.params[name].grad.detach().cpu().numpy().astype(np.float64)
        worst = max(worst, float(np.abs(mine - g).max() / max(np.abs(g).max(), 1e-30)))
    rel = abs(float(loss.detach()) - ref_loss) / abs(ref_loss)
    return {"loss_torch": float(loss.detach()), "loss_zerompi_f64": ref_loss, "loss_rel": rel, "grad_worst_rel": worst,
            "ok": rel <= LOSS_RTOL and worst <= GRAD_TOL}


def torch_step(torch, layers, cfg, idx, targets, device, bf16: bool):
    """A function running one PyTorch training step of the batch (forward, backward, AdamW)."""
    from torch_gpt import TorchGPT
    m = TorchGPT(layers, cfg.n_head, device)
    z = cfg.zero
    opt = torch.optim.AdamW(list(m.params.values()), lr=z.lr, betas=(z.beta1, z.beta2), eps=z.eps,
                            weight_decay=z.weight_decay, **({"fused": True} if device.type == "cuda" else {}))
    idx, targets = torch.tensor(idx, device=device), torch.tensor(targets, device=device)
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else None

    def step():
        opt.zero_grad(set_to_none=True)
        if ctx is None:
            loss = m.loss(idx, targets)
        else:
            with ctx():
                loss = m.loss(idx, targets)
        loss.backward()
        opt.step()
    return step


def zerompi_step(cfg, model, data, dtype: str, device: str, comm):
    """(a function running zerompi's training step at N = 1, stage 0, or None, why not)."""
    from zerompi import ZeroEngine
    from zerompi.errors import ConfigError
    from zerompi.train.job import step_losses
    _, _, engine_comm, _ = placed(device, comm)
    try:
        engine = ZeroEngine(model.init_layers(), replace(cfg.zero, stage=0, dtype=dtype), engine_comm(), xp=model.xp)
    except ConfigError as e:
        return None, str(e)
    losses_of, count = step_losses("gpt"), [0]

    def step():
        losses_of(engine, model, data, count[0], cfg.batch, cfg.zero.micro_batches)
        engine.step()
        count[0] += 1
    return step, ""


def measure(name: str, a, torch, comm) -> dict:
    from zerompi.train.config import parse_config
    from zerompi.train.run import build_model
    cfg = parse_config(MODELS[name] + ["--device", a.device])
    xp, placement, _, sync = placed(a.device, comm)
    model, data = build_model(cfg, xp)
    layers = model.init_layers()
    rows = data.train_rows(0, range(cfg.batch))
    idx, targets = rows[:, :-1].astype(np.int64), rows[:, 1:].astype(np.int64)
    device = torch.device("cuda" if a.device == "gpu" else "cpu")
    check = parity(torch, model, layers, idx, targets, device)
    rec = {"model": name, "flags": MODELS[name], "device": placement.describe(), "torch": torch.__version__,
           "tokens_per_step": int(idx.size), "parity": check, "skipped": {}}
    if not check["ok"]:
        return rec
    torch_sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    parts = {"torch_fp32": torch_step(torch, layers, cfg, idx, targets, device, False),
             "torch_bf16": torch_step(torch, layers, cfg, idx, targets, device, True)}
    for dtype in ("fp32", "bf16"):
        fn, why = zerompi_step(cfg, model, data, dtype, a.device, comm)
        if fn is None:
            rec["skipped"][f"zerompi_{dtype}"] = why
        else:
            parts[f"zerompi_{dtype}"] = fn
    for _ in range(a.warmup):
        for fn in parts.values():
            fn()
    times = {k: [] for k in parts}
    for _ in range(a.repeats):
        for k, fn in parts.items():
            sync(), torch_sync()
            t0 = time.perf_counter()
            fn()
            sync(), torch_sync()
            times[k].append(time.perf_counter() - t0)
    med = statistics.median
    rec["step_s"] = {k: med(v) for k, v in times.items()}
    rec["tokens_per_s"] = {k: idx.size / v for k, v in rec["step_s"].items()}
    for dtype in ("fp32", "bf16"):
        if f"zerompi_{dtype}" in times:
            rec[f"zerompi_over_torch_{dtype}"] = med(z / t for z, t in zip(times[f"zerompi_{dtype}"],
                                                                         times[f"torch_{dtype}"]))
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpts = ", ".join(m for m in MODELS if m.startswith("gpt"))
    p.add_argument("--models", default="gpt-default", help=f"comma-separated, of {gpts}")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--repeats", type=int, default=10, help="timed steps of each part, interleaved")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each part first")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for both (torch.set_num_threads, BLAS)")
    p.add_argument("--json", help="also write the records (a JSON list) to this file")
    a = p.parse_args(argv)
    names = a.models.split(",")
    bad = [m for m in names if m not in MODELS or not m.startswith("gpt")]
    if bad or a.repeats < 1 or a.warmup < 0:
        p.error(f"unknown GPT models {bad}" if bad else "--repeats must be >= 1 and --warmup >= 0")
    try:
        import torch
    except ImportError as e:
        sys.stderr.write(f"bench_torch_gpt: needs PyTorch beside zerompi ({e}); pip install torch\n")
        return 2
    if a.device == "gpu" and not torch.cuda.is_available():
        sys.stderr.write("bench_torch_gpt: --device gpu but PyTorch sees no CUDA device\n")
        return 2
    torch.set_num_threads(a.threads)
    from mpi4py import MPI
    records = [measure(n, a, torch, MPI.COMM_WORLD) for n in names]
    for r in records:
        print(json.dumps(r))
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    return 0 if all(r["parity"]["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
