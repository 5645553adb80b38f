"""--init-from DIR: a Hugging Face GPT-2 folder as the GPT's initial parameters, each rank reading its own shard.

Oracles: the folder's own tensors (read through the safetensors headers, checked against the ``safetensors``
package in test_hf_export.py), and the GPT's one-process loss (models/gpt.py's loss_and_grads) on the
same rows; test_hf_transformers.py compares logits with transformers itself.
"""
import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest

from tests.mpirun import ROOT, one_line, run_mpi, run_train
from tests.test_hf_export import GPT, cli
from zerompi.checkpoint.cli import consolidate
from zerompi.checkpoint.hf_names import hf_name
from zerompi.train.data import GeneratedData
from zerompi.train.hf_init import HFInit
from zerompi.train.models.gpt import GPT as Model

# Training that leaves the parameters' bits: lr 1e-30 moves no value above 1e-22 by a unit in the last place.
STILL = ["--lr", "1e-30", "--weight-decay", "0", "--dtype", "fp32", "--steps", "1"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A GPT trained 3 steps at N=2, exported in shards: (folder, consolidated parameters)."""
    tmp = tmp_path_factory.mktemp("hf")
    run_train(2, tmp, *GPT, "--stage", "3", "--steps", "3", "--save-dir", tmp / "ck")
    proc = cli("export-hf", tmp / "ck", tmp / "out", "--max-shard-size", "30KB")
    assert proc.returncode == 0, proc.stderr
    return tmp / "out", consolidate(str(tmp / "ck"), str(tmp / "p.npz"))


def _model(folder, tp=None):
    init = HFInit(str(folder))
    s = init.sizes
    return Model(init.vocab, s["n_positions"], s["n_layer"], s["n_head"], s["d_model"], kernels="numpy",
                 tp=tp, initial=init.rule)


def test_export_then_import_gives_the_same_bits(exported):
    """The import's lazy rules make the exported parameters bit for bit, whole and as each TP rank's pieces."""
    from zerompi.comm.tp_pieces import merge
    folder, params = exported
    whole = {n: a for _, p in _model(folder).init_layers() for n, a in p.items()}
    assert sorted(whole) == sorted(params)
    for name, value in params.items():
        np.testing.assert_array_equal(whole[name], value, err_msg=name)
    tps = [_model(folder, SimpleNamespace(size=2, rank=r)) for r in range(2)]
    pieces = [{n: a for _, p in m.init_layers() for n, a in p.items()} for m in tps]
    split = tps[0].tp_split()
    for name, value in params.items():
        got = merge([p[name] for p in pieces], *split[name]) if name in split else pieces[1][name]
        np.testing.assert_array_equal(got, value, err_msg=name)


def test_import_reads_fp16_and_bf16(exported, tmp_path):
    """A folder of fp16 or bf16 tensors imports as their float32 values."""
    import ml_dtypes
    from zerompi.checkpoint.hf_export import export
    folder, params = exported
    ck = folder.parent / "ck"
    for dtype, np_type in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        export(str(ck), str(tmp_path / dtype), dtype)
        whole = {n: a for _, p in _model(tmp_path / dtype).init_layers() for n, a in p.items()}
        for name, value in params.items():
            np.testing.assert_array_equal(whole[name], value.astype(np_type).astype(np.float32))


def _same_bits(a: np.ndarray, b: np.ndarray, name: str) -> None:
    """Equal bits where a value is not ~0 (one step of lr 1e-30 moves only those), within 1e-28 there."""
    big = np.abs(a) > 1e-20
    np.testing.assert_array_equal(a[big], b[big], err_msg=name)
    assert np.abs(a - b).max() <= 1e-28, name


@pytest.mark.parametrize("mesh", [["--tp", "2"], ["--pp", "2", "--micro-batches", "2"]])
def test_import_at_stage_3_on_a_mesh(exported, tmp_path, mesh):
    """N=4, stage 3, --tp 2 or --pp 2, from the folder: its first loss is the one-process GPT's on the same rows
    with the exported values, and its checkpoint exports back to the folder's tensors."""
    folder, params = exported
    m = run_train(4, tmp_path, "--init-from", folder, "--batch", "8", "--stage", "3", "--eval-every", "0",
                  *mesh, *STILL, "--save-dir", tmp_path / "ck")
    model = _model(folder)
    rows = GeneratedData(16, 0).train_rows(0, range(8))
    loss, _ = model.loss_and_grads(model.init_layers(), rows[:, :-1], rows[:, 1:])
    assert abs(m["losses"][0] - loss) < 1e-5, (m["losses"][0], loss)
    back = consolidate(str(tmp_path / "ck"), str(tmp_path / "back.npz"))
    for name, value in params.items():
        _same_bits(value, back[name], name)


def _broken(exported, tmp_path, change):
    """A copy of the exported folder, ``change``d: its path."""
    folder = tmp_path / "bad"
    shutil.copytree(exported[0], folder)
    change(folder)
    return folder


def _config(folder, **fields):
    path = folder / "config.json"
    c = json.loads(path.read_text())
    c.update(fields)
    path.write_text(json.dumps(c))


def _shrink_one(folder):
    """Rewrite the file holding h.1.mlp.c_fc.weight with that tensor one row short (a valid safetensors file)."""
    st = pytest.importorskip("safetensors.numpy")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name = "transformer.h.1.mlp.c_fc.weight"
    path = folder / index[name]
    tensors = st.load_file(str(path))
    tensors[name] = tensors[name][:-1].copy()
    os.unlink(path)
    st.save_file(tensors, str(path), metadata={"format": "pt"})


def _drop_one(folder):
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = hf_name("block0.ln2.b")
    st = pytest.importorskip("safetensors.numpy")
    path = folder / index["weight_map"].pop(name)
    tensors = st.load_file(str(path))
    del tensors[name]
    os.unlink(path)
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def _truncate_one(folder):
    path = folder / "model-00001-of-00005.safetensors"
    os.truncate(path, path.stat().st_size - 4)


@pytest.mark.parametrize("change,needle", [
    (lambda f: os.unlink(f / "config.json"), "has no config.json"),
    (lambda f: _config(f, model_type="llama"), "model_type 'llama' is not GPT-2's"),
    (lambda f: _config(f, activation_function="relu"), "activation_function 'relu'"),
    (lambda f: _config(f, layer_norm_epsilon=1e-6), "layer_norm_epsilon 1e-06"),
    (_drop_one, "lack tensor 'block0.ln2.b'"),
    (_shrink_one, "tensor 'transformer.h.1.mlp.c_fc.weight' has shape [31, 128]"),
    (_truncate_one, "that do not fit it or the file"),
])
def test_import_refusals(exported, tmp_path, change, needle):
    """A folder that is not a GPT-2 zerompi can start from: one line on every rank's behalf, exit 2."""
    folder = _broken(exported, tmp_path, change)
    proc = run_mpi(2, ["-m", "zerompi.train", "--init-from", folder, "--steps", "1"], check=False)
    one_line(proc, 2, needle)


def test_import_refuses_contradicting_flags(exported, tmp_path):
    """A size flag that contradicts the folder's config, or --resume beside it: one line, exit 2."""
    folder = exported[0]
    proc = run_mpi(2, ["-m", "zerompi.train", "--init-from", folder, "--n-layer", "3", "--steps", "1"], check=False)
    one_line(proc, 2, "--n-layer 3 contradicts init_from=", "(n_layer 2 in its config.json)")
    proc = run_mpi(2, ["-m", "zerompi.train", "--init-from", folder, "--resume", folder.parent / "ck",
                       "--steps", "5"], check=False)
    one_line(proc, 2, "give one of the two")
    proc = run_mpi(2, ["-m", "zerompi.train", "--init-from", folder, "--data", __file__, "--steps", "1"],
                   check=False)
    one_line(proc, 2, "has vocab_size 32, and the data's tokens go up to 255")


def test_each_rank_reads_its_own_shard(exported, tmp_path):
    """At N=4 stage 3 a rank reads its own slice of every bucket and the slice it checks (engine/initial.py): half
    the model's elements, not all of them; every element is read by some rank."""
    folder, params = exported
    total = sum(v.size for v in params.values())
    run_mpi(4, [ROOT / "tests" / "drivers" / "hf_reads.py", tmp_path / "reads", "--init-from", folder, "--batch", "8",
                "--stage", "3", "--eval-every", "0", *STILL])
    counts = {r: int((tmp_path / f"reads.{r}").read_text()) for r in range(4)}
    assert all(n <= 0.55 * total for n in counts.values()), (counts, total)
    assert sum(counts.values()) >= 2 * total * 0.95
