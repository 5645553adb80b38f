"""Where the kernel sources (the repository's ``kernels/`` folder) are, checkout or installed.

A source checkout (and an editable install) has them beside the package, in
``<repo>/kernels``; ``pip install .`` copies them into the package as ``zerompi/kernels``
(setup.py maps that package onto the folder). The one marker file both must contain
decides which folder is the real one.
"""
from pathlib import Path

MARKER = "adamw_math.h"   # the per-element math every kernel includes


def kernels_dir() -> Path:
    """The folder holding the kernel sources; raises FileNotFoundError naming where it looked."""
    package = Path(__file__).resolve().parent.parent   # zerompi/
    candidates = (package / "kernels", package.parent / "kernels")
    for folder in candidates:
        if (folder / MARKER).is_file():
            return folder
    raise FileNotFoundError(f"kernel sources ({MARKER}) not found in {' or '.join(map(str, candidates))}; "
                            "reinstall zerompi (pip install .) or run from a source checkout")


def read_source(name: str) -> str:
    """Text of one kernel source file, e.g. ``read_source("fused_adamw.cu")``."""
    return (kernels_dir() / name).read_text(encoding="utf-8")
