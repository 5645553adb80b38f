"""zerompi: ZeRO stages 0-3 on MPI with NumPy/CuPy flat buffers."""
from setuptools import find_packages, setup

setup(
    name="zerompi",
    version="0.1.0",
    description="ZeRO (stages 0-3) training engine on mpi4py and NumPy/CuPy, no framework",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    # kernels/ (C and CUDA sources, compiled on first use) ships inside the package as zerompi/kernels.
    packages=find_packages(include=["zerompi", "zerompi.*"]) + ["zerompi.kernels"],
    package_dir={"zerompi.kernels": "kernels"},
    package_data={"zerompi.kernels": ["*.h", "*.c", "*.cu"]},
    python_requires=">=3.9",
    install_requires=["numpy>=1.22", "mpi4py>=3.1", "ml_dtypes>=0.2"],   # ml_dtypes: NumPy's bfloat16 (--dtype bf16)
    extras_require={
        # MPICH from PyPI: measured faster than the Open MPI wheel here (README, "MPI").
        "mpi": ["mpich"],
        "test": ["pytest>=7", "pytest-mpi", "pytest-timeout", "matplotlib"],   # matplotlib: the plot tests draw
        "gpu": ["cupy-cuda12x>=13"],   # ndarray.get(blocking=False), used by comm/staging.py, is new in CuPy 13
        "plot": ["matplotlib"],
        # Hugging Face interop (docs/interop.md): tokenizers for `python -m zerompi.data prepare`, tensorboardX for
        # --tensorboard and tensorboard to view (and read back) its files; safetensors, the format's own reader,
        # checks what export-hf writes (which needs nothing).
        "hf": ["safetensors>=0.4", "tokenizers>=0.15", "tensorboardX>=2.6", "tensorboard>=2.14"],
        # The interop's tests against transformers' GPT-2 itself (skipped without).
        "hf-test": ["torch>=2.1", "transformers>=4.40"],
    },
    entry_points={"console_scripts": ["zerompi-train=zerompi.train.run:main"]},
)
