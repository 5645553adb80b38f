"""Train the MoE GPT with its model on the array path CuPy takes (tests/fake_cupy.py's strict NumPy stand-in),
the ZeRO engines on the host as on the CPU; then the same configurations on the CPU path (the C kernels). Rank 0
prints one JSON line per run, ``path`` "xp" or "cpu".

The model computes on ``xp``: every layer's forward and backward, the head, the router, the experts, the aux
loss, capacity drops, the selection bias and the expert-parallel all-to-all (staged through host buffers), so a
NumPy function called on one of its arrays, or a host array mixed into them, fails the run. Where the engines
hand it parameters and take its gradients, the copies are explicit (up: ``xp.asarray``; down: ``xp.asnumpy``):
the engines' own device path is tested apart (tests/test_staging.py, tests/test_gpu.py).

Usage: mpiexec -n N python tests/drivers/moe_xp.py '[["--stage", "0", ...], ...]'
"""
import json
import sys
from contextlib import contextmanager

from mpi4py import MPI

from tests.fake_cupy import xp
from zerompi.errors import install_abort_hook
from zerompi.train import run
from zerompi.train.config import parse_config
from zerompi.train.moe import ep_mlp

install_abort_hook()
build_cpu, store_params, store_grads = run.build_model, ep_mlp.ExpertStore.params, ep_mlp.ExpertStore.grads


def up(a):
    return None if a is None else xp.asarray(a)


def down(d):
    return {k: xp.asnumpy(v) for k, v in d.items()}


def on_device(model):
    """``model`` (a GPT on xp) with the engine's host arrays copied up at its boundary and its results down
    (idle_layer passes its rows through, the expert-parallel block's exchanges on xp)."""
    fwd, bwd, parts, head, losses = (model.forward_layer, model.backward_layer, model.backward_layer_parts,
                                     model.head, model.token_losses)

    def forward_layer(i, params, x, *ws):
        out, cache = fwd(i, up_params(params), up(x), *ws)
        return xp.asnumpy(out), cache

    def backward_layer(i, params, cache, dy, *ws):
        dx, g = bwd(i, up_params(params), cache, up(dy), *ws)
        return (None if dx is None else xp.asnumpy(dx)), down(g)

    def backward_layer_parts(i, params, cache, dy, *ws):
        dx, weights = parts(i, up_params(params), cache, up(dy), *ws)
        return xp.asnumpy(dx), lambda: down(weights())

    def head_(wte, hf, targets, *rest):
        loss, dh, dwte = head(up(wte), up(hf), up(targets), *rest)
        return loss, xp.asnumpy(dh), xp.asnumpy(dwte)

    model.forward_layer, model.backward_layer, model.backward_layer_parts = forward_layer, backward_layer, \
        backward_layer_parts
    model.head = head_
    model.token_losses = lambda wte, hf, targets: losses(up(wte), up(hf), up(targets))
    return model


def up_params(params):
    return None if params is None else {k: up(v) for k, v in params.items()}


def build_xp(cfg, _xp=None, mesh=None):
    model, data = build_cpu(cfg, xp, mesh)
    return on_device(model), data


@contextmanager
def params_up(self, block):
    with store_params(self, block) as p:
        yield {k: xp.asarray(v) for k, v in p.items()}


def grads_down(self, block, grads):
    store_grads(self, block, down(grads))


for path in ("xp", "cpu"):
    if path == "xp":
        run.build_model, ep_mlp.ExpertStore.params, ep_mlp.ExpertStore.grads = build_xp, params_up, grads_down
    else:
        run.build_model, ep_mlp.ExpertStore.params, ep_mlp.ExpertStore.grads = build_cpu, store_params, store_grads
    for flags in json.loads(sys.argv[1]):
        metrics = run.train(parse_config(flags))
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("METRICS " + json.dumps({"path": path, "flags": flags, **metrics}), flush=True)
