"""One micro-batch of a GPT run as the engine driver runs it (model.activations, the model's workspace), on
parameters given as (name, dict) layers: the split drivers (tp_model.py, sp_model.py) check it against the
full model."""
import numpy as np

from zerompi.train.models.gpt import WTE


def one_pass(model, layers, idx, tgt):
    """Loss and gradients (copies) of one micro-batch."""
    params, run = [p for _, p in layers], model.activations
    h, caches = idx, []
    for i, p in enumerate(params):
        h, c = run.forward(i, p, h)
        caches.append(c)
    loss, dh, dwte = model.head(params[0][WTE], h, tgt, 1.0, model.workspace)
    grads = {}
    for i in reversed(range(len(params))):
        dh, g = run.backward(i, params[i], caches[i], dh)
        grads.update({k: np.array(v, copy=True) for k, v in g.items()})
    grads[WTE] = grads[WTE] + dwte
    return loss, grads
