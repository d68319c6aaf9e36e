"""The library stays a library: nothing under aligner/ imports benchmarks/ or names a script or launcher file as a
path to start, and setup.py ships aligner only (benchmarks/ is repo tooling beside scripts/)."""

import ast
import os
import re

from setuptools import find_packages

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A whole string that is a path into scripts/ or launchers/ (a message or docstring that mentions one is fine).
REPO_TOOL_PATH = re.compile(r"^(\.?/)?(scripts|launchers)(/[\w./-]*)?$")


def _library_modules():
    for root, _, files in os.walk(os.path.join(REPO, "aligner")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    yield os.path.relpath(path, REPO), ast.parse(f.read())


def test_no_library_module_imports_benchmarks_or_starts_a_repo_script():
    found = []
    for rel, tree in _library_modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                names = []
            found += [f"{rel}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and REPO_TOOL_PATH.match(node.value):
                found.append(f"{rel}:{node.lineno} names {node.value!r}")
    assert not found, found


def test_setup_py_ships_aligner_only():
    with open(os.path.join(REPO, "setup.py")) as f:
        tree = ast.parse(f.read())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "find_packages"]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    packages = find_packages(REPO, **kwargs)
    assert "aligner" in packages and all(p == "aligner" or p.startswith("aligner.") for p in packages), packages
    assert os.path.isfile(os.path.join(REPO, "benchmarks", "__init__.py"))  # it exists, and is left out
