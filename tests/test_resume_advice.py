"""Messages that recommend a --resume form: following the advice must work.

A save folder of a --tp or --pp run was met with "pass --resume DIR to continue that run", which was
then refused ("a tensor-parallel save ...: resume it with --tp 2"); a folder with no complete checkpoint
was advised --resume too, which can only be refused; a resume with another mesh named no flags. Each
test reads the advice off the one error line and runs it."""
import re

import pytest

from tests.mpirun import one_line, run_mpi

LIMIT = 120
MLP = ["-m", "zerompi.train", "--model", "mlp", "--width", "16", "--depth", "2", "--batch", "8", "--progress", "lines"]
MESHES = {"tp": ["--tp", "2"], "pp": ["--pp", "2", "--micro-batches", "2"]}


def _saved(tmp_path, mesh: str):
    ck = tmp_path / f"ck_{mesh}"
    run_mpi(2, [*MLP, *MESHES[mesh], "--steps", "2", "--save-dir", ck], timeout=LIMIT)
    return ck


def _follow(flags: str, *extra):
    """Run the advised flags (plus ``extra``) and check that the run resumed."""
    proc = run_mpi(2, [*MLP, *flags.split(), *extra], timeout=LIMIT, check=False)
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr
    return proc


@pytest.mark.parametrize("mesh", ["tp", "pp"])
def test_a_save_folder_held_by_another_run_advises_a_resume_that_works(tmp_path, mesh):
    ck = _saved(tmp_path, mesh)
    proc = run_mpi(2, [*MLP, "--steps", "4", "--save-dir", ck], timeout=LIMIT, check=False)
    line = one_line(proc, 2, f"save_dir='{ck}' already holds checkpoints")
    advice = re.search(r"pass (--resume .*?) \(and --steps above (\d+)\) to continue that run", line)
    assert advice and advice.group(2) == "2", line
    want = {"tp": f"--resume {ck} --tp 2", "pp": f"--resume {ck} --pp 2"}[mesh]
    assert advice.group(1) == want, line
    extra = ["--micro-batches", "2"] if mesh == "pp" else []     # the 1f1b schedule on 2 stages needs 2
    _follow(advice.group(1), "--steps", "4", "--save-dir", str(ck), *extra)


@pytest.mark.parametrize("saved,other", [("tp", "pp"), ("pp", "tp")])
def test_a_resume_with_another_mesh_names_the_mesh_it_was_saved_with(tmp_path, saved, other):
    ck = _saved(tmp_path, saved)
    proc = run_mpi(2, [*MLP, *MESHES[other], "--steps", "4", "--resume", ck], timeout=LIMIT, check=False)
    line = one_line(proc, 2, f"{ck}:")
    advice = re.search(r"resume it with the mesh it was saved with \((--resume [^)]*)\)", line)
    assert advice, line
    extra = ["--micro-batches", "2"] if saved == "pp" else []
    _follow(advice.group(1), "--steps", "4", *extra)


def test_a_save_folder_with_no_complete_checkpoint_advises_no_resume(tmp_path):
    ck = tmp_path / "ck"
    (ck / "step_000002").mkdir(parents=True)          # a save that never completed: no manifest
    (ck / "latest").write_text("step_000002\n")
    proc = run_mpi(2, [*MLP, "--steps", "2", "--save-dir", ck], timeout=LIMIT, check=False)
    line = one_line(proc, 2, "already holds checkpoints (none complete", "--overwrite to replace them")
    assert "--resume" not in line                     # it would be refused: 'holds no complete checkpoint'
    proc = run_mpi(2, [*MLP, "--steps", "2", "--resume", ck], timeout=LIMIT, check=False)
    one_line(proc, 2, "holds no complete checkpoint")
