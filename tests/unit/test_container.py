"""containers/Dockerfile agrees with setup.py and with the launchers (no Docker engine runs here, so the image is
never built in CI: these checks stand in for the build).

The Dockerfile is parsed, not run: ARG defaults, and the requirements of every `pip install` with `${ARG}`s expanded.
"""

import ast
import os
import re
import shlex
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKERFILE = os.path.join(ROOT, "containers", "Dockerfile")


def setup_requires() -> dict[str, Requirement]:
    """INSTALL_REQUIRES of setup.py, read from its syntax tree (setup.py is not executed)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INSTALL_REQUIRES" for t in node.targets):
            reqs = [Requirement(s) for s in ast.literal_eval(node.value)]
            return {canonicalize_name(r.name): r for r in reqs}
    raise AssertionError("setup.py has no INSTALL_REQUIRES list")


def docker_lines() -> list[str]:
    with open(DOCKERFILE) as f:
        text = f.read()
    text = re.sub(r"\\\n", " ", text)  # continuation lines
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def docker_args() -> dict[str, str]:
    args = {}
    for line in docker_lines():
        if line.startswith("ARG ") and "=" in line:
            name, value = line[4:].split("=", 1)
            args[name.strip()] = shlex.split(value)[0] if value.strip() else ""
    return args


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def pip_installs() -> list[tuple[str, Requirement]]:
    """(the RUN line, requirement) for every requirement string that a `pip install` in the Dockerfile names."""
    args, out = docker_args(), []
    for line in docker_lines():
        if not line.startswith("RUN "):
            continue
        for segment in re.split(r"&&|;|\bthen\b", line):
            words = segment.split()
            if "pip" not in words or "install" not in words:
                continue
            tokens = shlex.split(expand(segment, args))
            for token in tokens[tokens.index("install") + 1 :]:
                if token.startswith("-") or token.startswith("/") or token.startswith("http") or token == ".":
                    continue
                out.append((line, Requirement(token)))
    return out


def installed() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for _, r in pip_installs()}


def test_dockerfile_pins_agree_with_setup_py():
    setup, image = setup_requires(), installed()
    shared = set(setup) & set(image)
    assert {"megatron-core", "nvidia-pytriton", "numpy"} <= shared
    for name in shared:
        want, got = setup[name].specifier, image[name].specifier
        pinned = [s.version for s in got if s.operator == "=="]
        if pinned:  # an exact version in the image must be one that setup.py accepts
            assert want.contains(Version(pinned[0]), prereleases=True), f"{name}: image {got}, setup.py {want}"
        else:
            assert str(got) == str(want), f"{name}: image {got}, setup.py {want}"


def test_every_exact_pin_of_setup_py_is_pinned_in_the_image():
    image = installed()
    for name, req in setup_requires().items():
        if any(s.operator == "==" for s in req.specifier):
            assert name in image, f"setup.py pins {req} but the Dockerfile does not install it"
            assert str(image[name].specifier) == str(req.specifier), f"{name}: {image[name]} vs setup.py {req}"


def test_base_image_provides_torch_transformer_engine_and_apex():
    args = docker_args()
    assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:"), args["BASE_IMAGE"]
    assert "FROM ${BASE_IMAGE}" in docker_lines()
    names = set(installed())
    assert not names & {"torch", "transformer-engine", "apex", "flash-attn"}, (
        "the base image's CUDA builds are used as they are (PyPI's apex is not NVIDIA apex)"
    )
    assert "ENV PIP_CONSTRAINT=/opt/torch-constraint.txt" in docker_lines(), "pip must not replace the image's torch"


def test_tensorrt_llm_is_an_optional_build_argument():
    assert docker_args()["WITH_TRTLLM"] == "0"
    lines = [line for line, req in pip_installs() if canonicalize_name(req.name) == "tensorrt-llm"]
    assert lines and all('if [ "${WITH_TRTLLM}" = "1" ]' in line for line in lines)
    assert str(installed()["tensorrt-llm"].specifier) == f"=={docker_args()['TRTLLM_VERSION']}"


def test_package_installed_where_the_launchers_look_for_it():
    lines = docker_lines()
    assert "COPY . /opt/aligner" in lines and "WORKDIR /opt/aligner" in lines
    assert any(line.startswith("RUN pip install -e /opt/aligner") for line in lines)
    with open(os.path.join(ROOT, "launchers", "slurm", "common.sh")) as f:
        assert 'STEP_ROOT="${CONTAINER_ROOT:-/opt/aligner}"' in f.read()
    check = next(line for line in lines if "check_image.py" in line)
    for flag, arg in (("--megatron-core", "MEGATRON_CORE_VERSION"), ("--pytriton", "PYTRITON_VERSION")):
        assert f'{flag} "${{{arg}}}"' in check


def test_check_image_names_a_wrong_pin_and_nothing_else_here():
    """One run: the dev environment passes every check but the deliberately wrong megatron-core pin."""
    pins = {
        n: [s.version for s in r.specifier][0]
        for n, r in setup_requires().items()
        if n in ("megatron-core", "nvidia-pytriton")
    }
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "containers", "check_image.py"),
            "--megatron-core",
            "0.0.1",
            "--pytriton",
            pins["nvidia-pytriton"],
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    problems = [line for line in proc.stderr.splitlines() if line.startswith("check_image: ")]
    assert proc.returncode == 1
    assert problems == [f"check_image: megatron-core is {pins['megatron-core']}, expected 0.0.1"], proc.stderr[-2000:]
