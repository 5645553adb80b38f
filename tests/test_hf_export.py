"""export-hf: a GPT checkpoint of any world size, stage, --tp and --pp as Hugging Face GPT-2 safetensors.

The oracles: ``consolidate`` (tested against the raw shards in test_checkpoint.py) for the values, and the
``safetensors`` package's own reader for the files (where it is installed: ``pip install -e '.[hf]'``);
test_hf_transformers.py loads the result in transformers itself.
"""
import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, run_train
from zerompi.checkpoint.cli import consolidate
from zerompi.checkpoint.hf_export import export
from zerompi.checkpoint.hf_names import hf_name
from zerompi.checkpoint.safetensors_files import INDEX, MappedTensor, read_header

GPT = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--log-every", "100", "--eval-every", "0"]


def read_export(out) -> dict:
    """{GPT-2 name: float32 array} of an exported folder, read through the headers (sharded or not)."""
    index = out / INDEX
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    got = {}
    for name in files:
        start, entries = read_header(str(out / name))
        for t, e in entries.items():
            got[t] = MappedTensor(str(out / name), start, e).read(0, int(np.prod(e.shape))).reshape(e.shape)
    return got


def cli(*args):
    return subprocess.run([sys.executable, "-m", "zerompi.checkpoint", *map(str, args)], capture_output=True,
                          text=True, timeout=120, env=mpi_env(), cwd=ROOT)


@pytest.mark.parametrize("n,mesh", [(4, ["--tp", "2"]), (4, ["--pp", "2", "--micro-batches", "2"]), (2, [])])
def test_export_equals_the_consolidated_parameters(tmp_path, n, mesh):
    """Trained a few steps at stage 3 (TP, a pipeline, plain), exported in small shards: every GPT-2 tensor is
    the consolidated parameter of its name, bit for bit, and the index names each tensor's file."""
    run_train(n, tmp_path, *GPT, *mesh, "--stage", "3", "--steps", "3", "--save-dir", tmp_path / "ck")
    params = consolidate(str(tmp_path / "ck"), str(tmp_path / "p.npz"))
    out = tmp_path / "hf"
    proc = cli("export-hf", tmp_path / "ck", out, "--max-shard-size", "20KB")
    assert proc.returncode == 0, proc.stderr
    assert "peak memory" in proc.stdout and "7 files" in proc.stdout, proc.stdout
    got = read_export(out)
    assert sorted(got) == sorted(hf_name(n) for n in params)
    for name, value in params.items():
        assert got[hf_name(name)].dtype == np.float32
        np.testing.assert_array_equal(got[hf_name(name)], value, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert (config["n_layer"], config["n_head"], config["n_embd"], config["vocab_size"], config["n_positions"]) == \
        (2, 4, 32, 32, 16)
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"] is True
    assert config["layer_norm_epsilon"] == 1e-5 and config["model_type"] == "gpt2"
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    for fname in set(weight_map.values()):
        assert all(weight_map[t] == fname for t in read_header(str(out / fname))[1])
    st = pytest.importorskip("safetensors.numpy")             # the format's own reader agrees
    for fname in set(weight_map.values()):
        for t, v in st.load_file(str(out / fname)).items():
            np.testing.assert_array_equal(v, got[t])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_export_casts_to_the_dtype(tmp_path, dtype):
    """--dtype fp16 / bf16: each value the float32 one rounded to that dtype; one file below the shard size."""
    import ml_dtypes
    run_train(2, tmp_path, *GPT, "--stage", "2", "--steps", "2", "--save-dir", tmp_path / "ck")
    params = consolidate(str(tmp_path / "ck"), str(tmp_path / "p.npz"))
    export(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype)
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    start, entries = read_header(str(tmp_path / "hf" / "model.safetensors"))
    want = np.float16 if dtype == "fp16" else ml_dtypes.bfloat16
    for name, value in params.items():
        e = entries[hf_name(name)]
        assert e.dtype == {"fp16": "F16", "bf16": "BF16"}[dtype]
        got = MappedTensor(str(tmp_path / "hf" / "model.safetensors"), start, e).read(0, value.size)
        np.testing.assert_array_equal(got, value.reshape(-1).astype(want).astype(np.float32))


def test_export_memory_is_a_read_buffer_not_the_model(tmp_path):
    """A 42 MB model (fp32) exports with a traced peak under a quarter of it: tensors are streamed, not held
    (the largest tensor alone is 2.4 MB; the shard checksum reads 4 MiB at a time)."""
    flags = ["--model", "gpt", "--n-layer", "6", "--d-model", "384", "--n-head", "6", "--seq-len", "8",
             "--batch", "2", "--log-every", "100", "--eval-every", "0"]
    run_train(2, tmp_path, *flags, "--stage", "3", "--steps", "1", "--save-dir", tmp_path / "ck", timeout=300)
    tracemalloc.start()
    try:
        done = export(str(tmp_path / "ck"), str(tmp_path / "hf"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    model = 4 * done["params"]
    assert model > 40e6
    assert peak < model / 4, (peak, model)


def test_export_refusals(tmp_path):
    """Bad input is one line and exit 2, nothing written: the output is the checkpoint, inside it, or a folder
    that holds something; a checkpoint that is not a GPT's; a bad shard size."""
    run_train(2, tmp_path, *GPT, "--steps", "1", "--save-dir", tmp_path / "ck")
    run_train(2, tmp_path, "--model", "mlp", "--width", "8", "--depth", "2", "--steps", "1",
              "--save-dir", tmp_path / "mlp")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    cases = [((tmp_path / "ck",), "is also the input"),
             ((tmp_path / "ck" / "sub",), "lies inside the input"),
             ((tmp_path / "full",), "holds 1 entries"),
             ((tmp_path / "mlp",), "holds a zerompi checkpoint"),
             ((tmp_path / "hf", "--max-shard-size", "lots"), "is not a size"),
             ((tmp_path / "hf", "--n-head", "5"), "n_head=5 contradicts the checkpoint's n_head 4")]
    for args, needle in cases:
        proc = cli("export-hf", tmp_path / "ck", *args)
        assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    proc = cli("export-hf", tmp_path / "mlp", tmp_path / "hf")
    assert proc.returncode == 2 and "not a checkpoint of zerompi's GPT" in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ck" / "sub").exists()
    assert (tmp_path / "full" / "notes.txt").read_text() == "keep me"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]       # no half-made folder left
