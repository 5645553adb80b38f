"""zerompi's GPT and transformers' GPT2LMHeadModel are one model: exported checkpoints load there, its saved
models train here, and the logits agree within 1e-5 (fp32). Needs torch and transformers (skipped without).

Trained or imported at N=4, stage 3, with --tp 2 or --pp 2; zerompi's forward is the GPT's own layer code
(models/gpt.py) on the consolidated parameters, and its first training loss is the distributed forward's.
"""
import numpy as np
import pytest

from tests.mpirun import run_train
from tests.test_hf_export import GPT, cli
from tests.test_hf_import import STILL, _same_bits
from zerompi.checkpoint.cli import consolidate
from zerompi.checkpoint.hf_names import hf_name
from zerompi.train.data import GeneratedData
from zerompi.train.models.gpt import GPT as Model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESHES = [["--tp", "2"], ["--pp", "2", "--micro-batches", "2"]]


def zerompi_logits(params, tokens, n_head):
    """Logits (B, T, V) of zerompi's GPT with ``params`` (by name) on ``tokens``, in one process, fp32."""
    vocab, c = params["wte"].shape
    n_layer = len({n.split(".")[0] for n in params if n.startswith("block")})
    model = Model(vocab, params["wpe"].shape[0], n_layer, n_head, c, kernels="numpy")
    h = tokens
    for i, (_, names) in enumerate(model.lazy_layers()):
        h, _ = model.forward_layer(i, {n: params[n] for n in names}, h)
    return h @ params["wte"].T


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("mesh", MESHES)
def test_exported_checkpoint_gives_transformers_the_same_logits(tmp_path, mesh):
    """Trained 4 steps at N=4 stage 3 on a mesh, exported: GPT2LMHeadModel.from_pretrained's logits are zerompi's."""
    run_train(4, tmp_path, *GPT, *mesh, "--stage", "3", "--steps", "4", "--dtype", "fp32",
              "--save-dir", tmp_path / "ck")
    proc = cli("export-hf", tmp_path / "ck", tmp_path / "hf", "--max-shard-size", "40KB")
    assert proc.returncode == 0, proc.stderr
    params = consolidate(str(tmp_path / "ck"), str(tmp_path / "p.npz"))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = np.random.default_rng(1).integers(0, 32, (4, 16))
    ours, theirs = zerompi_logits(params, tokens, 4), hf_logits(model, tokens)
    assert np.abs(ours).max() > 0.1               # trained: not a model whose logits are all near 0
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def random_gpt2(seed: int):
    """A GPT2LMHeadModel of test_hf_export's GPT sizes, every parameter random (biases and LayerNorms too)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = ".ln_" in name and name.endswith(".weight")
            p.copy_(1 + 0.1 * torch.randn_like(p) if gain else 0.05 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("mesh", MESHES)
def test_transformers_model_imports_with_the_same_logits(tmp_path, mesh):
    """A random GPT2LMHeadModel saved with save_pretrained, imported with --init-from at N=4 stage 3 on a mesh:
    the first loss of the distributed run is transformers' loss on the same rows, the parameters keep their
    bits, and zerompi's logits are transformers'."""
    model = random_gpt2(0)
    model.save_pretrained(str(tmp_path / "hf"))
    m = run_train(4, tmp_path, "--init-from", tmp_path / "hf", "--batch", "8", "--stage", "3",
                  "--eval-every", "0", *mesh, *STILL, "--save-dir", tmp_path / "ck")
    rows = GeneratedData(16, 0).train_rows(0, range(8))
    logits = torch.tensor(hf_logits(model, rows[:, :-1])).reshape(-1, 32)
    loss = float(torch.nn.functional.cross_entropy(logits, torch.tensor(rows[:, 1:]).reshape(-1)))
    assert abs(m["losses"][0] - loss) < 1e-5, (m["losses"][0], loss)
    params = consolidate(str(tmp_path / "ck"), str(tmp_path / "p.npz"))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name, value in params.items():
        _same_bits(state[hf_name(name)], value, name)
    tokens = np.random.default_rng(2).integers(0, 32, (4, 16))
    np.testing.assert_allclose(zerompi_logits(params, tokens, 4), hf_logits(model, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype,torch_dtype,atol", [("fp16", "float16", 2e-2), ("bf16", "bfloat16", 1e-1)])
def test_a_half_precision_export_loads_in_transformers_in_its_dtype(tmp_path, dtype, torch_dtype, atol):
    """--dtype fp16 / bf16: from_pretrained(dtype="auto") loads the weights in that dtype (config.json says it),
    and their logits, computed in fp32, are the fp32 model's within the dtype's rounding."""
    run_train(2, tmp_path, *GPT, "--stage", "3", "--steps", "2", "--dtype", "fp32", "--save-dir", tmp_path / "ck")
    proc = cli("export-hf", tmp_path / "ck", tmp_path / "hf", "--dtype", dtype)
    assert proc.returncode == 0, proc.stderr
    half = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), dtype="auto").eval()
    assert {p.dtype for p in half.parameters()} == {getattr(torch, torch_dtype)}
    params = consolidate(str(tmp_path / "ck"), str(tmp_path / "p.npz"))
    tokens = np.random.default_rng(2).integers(0, 32, (2, 16))
    theirs = hf_logits(half.float(), tokens)
    np.testing.assert_allclose(zerompi_logits(params, tokens, 4), theirs, rtol=0, atol=atol)
