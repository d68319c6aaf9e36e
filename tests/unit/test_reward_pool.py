"""RewardPool (aligner/rewards/pool.py) with real worker processes: scores in order whatever the number of workers;
a function that raises, hangs, exits (sys.exit, os._exit) or returns a non-finite or malformed value gets an
error naming the function and the sample, and the pool keeps working after it."""

import os
import signal
import textwrap

import numpy as np
import pytest

from aligner.rewards.function import RewardFunctionError, split_spec
from aligner.rewards.pool import RewardPool

FUNCTIONS = textwrap.dedent(
    """
    import os, sys, time

    def length(prompts, responses, labels):
        return [len(r) + (0.5 if l == "half" else 0.0) for r, l in zip(responses, labels)]

    def no_labels(prompts, responses):
        return [float(len(p)) for p in prompts]

    def raises(prompts, responses):
        return [1.0 / (len(r) - 3) for r in responses]

    def hangs(prompts, responses):
        if "slow" in responses:
            time.sleep(120)
        return [0.0] * len(responses)

    def exits(prompts, responses):
        if "bye" in responses:
            sys.exit(3)
        return [0.0] * len(responses)

    def crashes(prompts, responses):
        if "bye" in responses:
            os._exit(7)
        return [0.0] * len(responses)

    def not_finite(prompts, responses):
        return [float("nan") if r == "nan" else (1e39 if r == "big" else 0.0) for r in responses]

    def wrong_count(prompts, responses):
        return [0.0]

    def not_numbers(prompts, responses):
        return ["high"] * len(responses)
    """
)
PROMPTS = ["p0", "p1", "p2", "p3"]


@pytest.fixture(scope="module")
def fns(tmp_path_factory):
    path = tmp_path_factory.mktemp("fns") / "fns.py"
    path.write_text(FUNCTIONS)
    return str(path)


def pool(fns, name, **kw):
    kw.setdefault("num_workers", 1)
    return RewardPool(f"{fns}:{name}", **kw)


def test_spec_names_a_function():
    assert split_spec("a/b.py") == ("a/b.py", "reward_fn")
    assert split_spec("a/b.py:score") == ("a/b.py", "score")


@pytest.mark.parametrize("workers, per_call", [(1, 1), (2, 3)])
def test_scores_come_back_in_order(fns, workers, per_call):
    p = pool(fns, "length", num_workers=workers, samples_per_call=per_call)
    try:
        out = p.score(PROMPTS, ["a", "bb", "ccc", "dddd"], [None, "half", None, None])
        assert out.dtype == np.float32 and out.tolist() == [1.0, 2.5, 3.0, 4.0]
    finally:
        p.close()
    p = pool(fns, "no_labels")
    try:
        assert p.score(["x", "yy"], ["", ""], ["l", "l"]).tolist() == [1.0, 2.0]
    finally:
        p.close()


def _fails(p, responses, *words):
    with pytest.raises(RewardFunctionError) as info:
        p.score(PROMPTS[: len(responses)], responses)
    message = str(info.value)
    for w in (p.spec, *words):
        assert w in message, message
    return message


def test_raise_names_function_and_sample_and_pool_recovers(fns):
    p = pool(fns, "raises")
    try:
        msg = _fails(p, ["a", "bb", "ccc", "dddd"], "sample 2 of 4", "'p2'", "'ccc'", "ZeroDivisionError")
        assert "Traceback" in msg and "1.0 / (len(r) - 3)" in msg, "the function's own traceback follows"
        assert p.score(PROMPTS[:2], ["a", "bb"]).tolist() == [-0.5, -1.0]
    finally:
        p.close()


def test_a_call_of_several_samples_names_its_range(fns):
    p = pool(fns, "raises", samples_per_call=2)
    try:
        _fails(p, ["a", "bb", "ccc", "dddd"], "samples 2..3 of 4")
    finally:
        p.close()


def test_hang_is_killed_at_the_timeout(fns):
    p = pool(fns, "hangs", timeout_s=1.0, num_workers=2)
    try:
        _fails(p, ["a", "slow", "b"], "sample 1 of 3", "'slow'", "reward.timeout=1 s")
        assert p.score(PROMPTS[:2], ["a", "b"]).tolist() == [0.0, 0.0]
    finally:
        p.close()


def test_sys_exit_is_reported_as_raised(fns):
    p = pool(fns, "exits")
    try:
        _fails(p, ["a", "bye"], "sample 1 of 2", "SystemExit: 3")
        assert p.score(PROMPTS[:1], ["a"]).tolist() == [0.0]
    finally:
        p.close()


def test_hard_exit_is_reported_with_its_code(fns):
    p = pool(fns, "crashes")
    try:
        _fails(p, ["a", "bye"], "sample 1 of 2", "exited with code 7")
        assert p.score(PROMPTS[:1], ["a"]).tolist() == [0.0]
    finally:
        p.close()


@pytest.mark.parametrize(
    "name, responses, words",
    [
        ("not_finite", ["a", "nan"], ("sample 1 of 2", "nan", "float32")),
        ("not_finite", ["big", "a"], ("sample 0 of 2", "1e+39", "float32")),  # finite in float64, inf in float32
        ("wrong_count", ["a", "b"], ("returned 1 scores for 1 samples",)),
        ("not_numbers", ["a"], ("'high'", "not a list of numbers")),
    ],
)
def test_bad_return_values_are_named(fns, name, responses, words):
    p = pool(fns, name, samples_per_call=1 if name != "wrong_count" else 2)
    try:
        if name == "wrong_count":
            words = ("samples 0..1 of 2", "returned 1 scores for 2 samples")
        _fails(p, responses, *words)
    finally:
        p.close()


def test_load_errors_name_the_file(fns, tmp_path):
    with pytest.raises(RewardFunctionError, match="defines no callable missing"):
        pool(fns, "missing")
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(RewardFunctionError, match="importing .*bad.py failed"):
        RewardPool(str(bad), num_workers=1)


def test_workers_outlive_sigterm(fns):
    """A launcher's SIGTERM goes to the whole process group: the workers must let the step finish."""
    p = pool(fns, "length")
    try:
        os.kill(p.workers[0].proc.pid, signal.SIGTERM)
        assert p.score(["p"], ["abc"], [None]).tolist() == [3.0]
    finally:
        p.close()
    assert not p.workers
