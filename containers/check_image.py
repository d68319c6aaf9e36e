"""Check an aligner image (the last step of containers/Dockerfile; also useful inside a running container).

    python containers/check_image.py [--torch-constraint FILE] [--megatron-core V] [--pytriton V] [--trtllm V]

Fails (exit 1, naming each problem) if torch is not the version in FILE (the base image's CUDA build was replaced),
numpy is 2 or newer (PyTriton 0.7 then returns empty tensors), a pinned package is missing or at another version, or
aligner, megatron.core or pytriton cannot be imported. Prints what the image holds, optional accelerators included.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import sys


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch-constraint", help="file with one line `torch==<version>`")
    p.add_argument("--megatron-core")
    p.add_argument("--pytriton")
    p.add_argument("--trtllm", default="", help="expected tensorrt-llm version ('' = not required)")
    args = p.parse_args(argv)
    problems = []
    if args.torch_constraint:
        with open(args.torch_constraint) as f:
            want = f.read().strip().split("==", 1)[1]
        if version("torch") != want:
            problems.append(f"torch is {version('torch')}, the base image had {want}: something replaced it")
    for dist, want in (
        ("megatron-core", args.megatron_core),
        ("nvidia-pytriton", args.pytriton),
        ("tensorrt-llm", args.trtllm or None),
    ):
        if want and version(dist) != want:
            problems.append(f"{dist} is {version(dist)}, expected {want}")
    numpy_version = version("numpy") or "0"
    if int(numpy_version.split(".")[0]) >= 2:
        problems.append(f"numpy {numpy_version}: PyTriton 0.7 needs numpy<2")
    for module in ("aligner", "aligner.critic.server", "megatron.core", "pytriton.triton"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - report every failure, not only ImportError
            problems.append(f"import {module} failed: {exc!r}")
    for dist in (
        "torch",
        "numpy",
        "megatron-core",
        "nvidia-pytriton",
        "transformer-engine",
        "apex",
        "tensorrt-llm",
        "aligner",
    ):
        print(f"  {dist:20s} {version(dist) or '-'}")
    for problem in problems:
        print(f"check_image: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
