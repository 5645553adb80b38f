"""--data FILE --data-format tokens (flat uint16/uint32 ids) and ``python -m zerompi.data prepare``.

Oracles: the file's ids read with np.fromfile and windowed here by data.py's rule (the row generator of
(seed, stream, step, row)); the GPT's one-process loss on those rows; the tokenizers package's own encode.
"""
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, one_line, run_mpi, run_train
from zerompi.train.data import TRAIN, _row_rng
from zerompi.train.models.gpt import GPT as Model
from zerompi.train.tokens import TokenData

SMALL = ["--n-layer", "1", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "4", "--eval-every", "0",
         "--dtype", "fp32", "--log-every", "100"]


def token_file(path, n=4000, vocab=700, dtype=np.uint16, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, n).astype(dtype)
    ids.tofile(path)
    return ids


def test_rows_are_windows_of_the_ids(tmp_path):
    """Training rows are the file's ids at data.py's random offsets of the head, held-out rows lie in the tail
    (the last 10%), for uint16 and uint32."""
    for dtype in (np.uint16, np.uint32):
        ids = token_file(tmp_path / "t.bin", vocab=70000 if dtype == np.uint32 else 700, dtype=dtype)
        d = TokenData(str(tmp_path / "t.bin"), 8, 3, np.dtype(dtype).name, 70000)
        assert (d.n_train, d.n_val) == (3600, 400)
        rows = d.train_rows(5, range(2, 6))
        for k, j in enumerate(range(2, 6)):
            start = int(_row_rng(3, TRAIN, 5, j).integers(3600 - 8))
            np.testing.assert_array_equal(rows[k], ids[start:start + 9])
        val = d.val_rows(range(d.val_size))
        assert val.min() >= 0 and all(any(np.array_equal(v, ids[s:s + 9]) for s in range(3600, 3992)) for v in val[:5])


def test_training_on_a_token_file(tmp_path):
    """N=2 stage 3 on a uint16 token file with --vocab: the model's vocabulary is --vocab and the first loss is the
    one-process GPT's on the rows read here from the file."""
    ids = token_file(tmp_path / "t.bin")
    m = run_train(2, tmp_path, "--data", tmp_path / "t.bin", "--data-format", "tokens", "--vocab", "800",
                  "--stage", "3", "--steps", "1", *SMALL)
    model = Model(800, 8, 1, 2, 16, kernels="numpy")
    rows = np.stack([ids[s:s + 9] for s in (int(_row_rng(0, TRAIN, 0, j).integers(3600 - 8)) for j in range(4))])
    loss, _ = model.loss_and_grads(model.init_layers(), rows[:, :-1].astype(np.int64), rows[:, 1:].astype(np.int64))
    assert abs(m["losses"][0] - loss) < 1e-5, (m["losses"][0], loss)


def test_token_file_refusals(tmp_path):
    """One line, exit 2: a length that is not a whole number of ids, an id not below the vocabulary (its first
    position named), a token flag without --data-format tokens."""
    ids = token_file(tmp_path / "t.bin")
    (tmp_path / "odd.bin").write_bytes(ids.tobytes() + b"x")
    base = ["-m", "zerompi.train", "--steps", "1", *SMALL]
    proc = run_mpi(2, base + ["--data", tmp_path / "odd.bin", "--data-format", "tokens"], check=False)
    one_line(proc, 2, "8,001 bytes, not a multiple of 2 (uint16 token ids)")
    first = int(np.argmax(ids >= 500))
    proc = run_mpi(2, base + ["--data", tmp_path / "t.bin", "--data-format", "tokens", "--vocab", "500"], check=False)
    one_line(proc, 2, f"token {ids[first]} at position {first:,} is not below the vocabulary of 500")
    proc = run_mpi(2, base + ["--data", tmp_path / "t.bin", "--token-dtype", "uint32"], check=False)
    one_line(proc, 2, "token_dtype='uint32' applies with --data-format tokens only")


def prepare(*args):
    return subprocess.run([sys.executable, "-m", "zerompi.data", "prepare", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=mpi_env(), cwd=ROOT)


def test_prepare_with_a_tokenizer_file_and_with_a_trained_bpe(tmp_path):
    """With a tokenizer.json the file holds exactly its ids of the text; without one a byte-level BPE of the given
    size is trained and saved beside it, and its ids decode back to the text."""
    tokenizers = pytest.importorskip("tokenizers")
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i}\n" for i in range(3000))
    (tmp_path / "t.txt").write_text(text)
    proc = prepare(tmp_path / "t.txt", "--out", tmp_path / "bpe.bin", "--vocab-size", "400")
    assert proc.returncode == 0, proc.stderr
    assert "vocab 400" in proc.stdout and "--data-format tokens --token-dtype uint16 --vocab 400" in proc.stdout
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.bin.tokenizer.json"))
    ids = np.fromfile(tmp_path / "bpe.bin", np.uint16)
    assert ids.max() < 400 and len(ids) < len(text) / 2          # merges learnt: fewer ids than bytes
    assert tok.decode(ids.tolist()) == text
    proc = prepare(tmp_path / "t.txt", "--out", tmp_path / "given.bin", "--tokenizer",
                   tmp_path / "bpe.bin.tokenizer.json", "--token-dtype", "uint32")
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_array_equal(np.fromfile(tmp_path / "given.bin", np.uint32), tok.encode(text).ids)
    proc = prepare(tmp_path / "t.txt", "--out", tmp_path / "t.txt")
    assert proc.returncode == 2 and "is also the input" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert (tmp_path / "t.txt").read_text() == text
