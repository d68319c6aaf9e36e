"""aligner: a Megatron-native RLHF (PPO) training suite.

torch is deliberately not pinned to a build: GPU clusters bring their own CUDA torch (NGC containers);
the README's CPU set-up installs the CPU wheel explicitly before this package.
"""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "torch>=2.5",
    "megatron-core==0.16.1",
    "nvidia-pytriton==0.7.0",
    "numpy<2",  # PyTriton 0.7 returns empty tensors under numpy 2
    "omegaconf>=2.4",  # Literal-typed config fields (2.3 rejects them)
    "transformers>=4.45",
    "tokenizers>=0.20",
    "safetensors>=0.4",
    "tqdm>=4.60",
    "tensorboard>=2.14",
    "psutil>=5.9",  # megatron dist checkpointing measures process memory with it
]

EXTRAS = {
    # MPI launch outside Slurm (`mpiexec -n N ...`); the mpich wheel brings mpiexec, no system MPI needed.
    "mpi": ["mpi4py>=4.0", "mpich>=4.2"],
    "plot": ["matplotlib>=3.7"],
    # Parquet prompt files and saved HF `datasets` directories (aligner/data/rows.py; JSONL needs nothing). pyarrow 26
    # needs numpy 2 at import time and declares no numpy requirement, so pip cannot see the clash with numpy<2 above.
    "data": ["pyarrow>=14,<26"],
    "dev": ["ruff==0.17.6"],  # pinned: `ruff format --check` is part of the test command
}
# `datasets` only writes the saved-dataset fixtures of tests/unit/test_data.py (aligner reads them with pyarrow).
EXTRAS["test"] = (
    ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "datasets>=2.16"]
    + EXTRAS["mpi"]
    + EXTRAS["plot"]
    + EXTRAS["data"]
    + EXTRAS["dev"]
)

setup(
    name="aligner",
    version="0.1.0",
    description="Megatron-native RLHF (PPO) training: actor job + PyTriton critic job",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["aligner", "aligner.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    include_package_data=True,
)
