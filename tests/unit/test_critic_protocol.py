"""The critic job's pure pieces: request validation, config rules, the reward-function adapter, the client's
unreachable-server error. No models, no server."""

import os
import socket
import time

import numpy as np
import pytest
from critic_harness import REPO, tiny_model

from aligner.config import ConfigError
from aligner.config.critic import CriticJobConfig, load_critic_config
from aligner.critic.protocol import CriticRequestError, Limits, check_infer, check_step, check_train
from aligner.critic.reward_fn import RewardFunction, RewardFunctionError
from aligner.critic.service import dp_rows

LIMITS = Limits(max_batch_size=4, max_seq_len=16, vocab_size=48, max_train_batch_size=6)
TOK = np.array([[5, 6, 7, 0], [8, 9, 0, 0]], dtype=np.int64)
LEN = np.array([[3], [2]], dtype=np.int64)


def _err(fn, *args) -> str:
    with pytest.raises(CriticRequestError) as info:
        fn(*args)
    return str(info.value)


def test_check_infer_accepts_and_normalises():
    tokens, lengths, prompt_lengths, labels = check_infer(TOK, LEN, np.array([[1], [0]]), [b"a", ""], LIMITS)
    assert tokens.dtype == np.int64 and lengths.tolist() == [3, 2] and prompt_lengths.tolist() == [1, 0]
    assert labels == ["a", None]
    _, _, _, labels = check_infer(TOK, LEN[:, 0], None, np.array([[b"x"], [b"y"]], dtype=object), LIMITS)
    assert labels == ["x", "y"]
    # padding beyond the length may hold anything (even ids outside the vocabulary)
    check_infer(np.array([[5, 6, 7, 99]]), [3], None, None, LIMITS)


@pytest.mark.parametrize(
    "tokens, lengths, prompt, expect",
    [
        (TOK[0], LEN, None, "send [B, T]"),
        (TOK.astype(np.float32), LEN, None, "dtype float32"),
        (TOK, LEN[:1], None, "lengths has 1 rows but tokens has 2"),
        (TOK, np.array([[5], [2]]), None, "lengths[0]=5 is outside 1..T=4"),
        (TOK, np.array([[0], [2]]), None, "lengths[0]=0 is outside"),
        (TOK[:0], LEN[:0], None, "empty batch"),
        (np.zeros((5, 4), np.int64), np.ones((5, 1), np.int64), None, "exceeds server.max_batch_size=4"),
        (np.zeros((1, 17), np.int64), [[1]], None, "must be 1..16 (server.max_seq_len)"),
        (np.array([[5, 48, 0, 0]]), [[2]], None, "tokens[0, 1]=48 is outside the vocabulary"),
        (TOK, LEN, np.array([[4], [0]]), "prompt_lengths[0]=4 is outside 0..lengths[0]=3"),
        (TOK, LEN, np.array([1, 1, 1]), "prompt_lengths has 3 rows"),
    ],
)
def test_check_infer_errors(tokens, lengths, prompt, expect):
    assert expect in _err(check_infer, tokens, lengths, prompt, None, LIMITS)


def test_check_infer_labels_count():
    assert "labels has 1 rows" in _err(check_infer, TOK, LEN, None, ["a"], LIMITS)


def test_check_train_errors():
    f = np.zeros((2, 4), np.float32)
    mask = np.array([[0, 1, 1, 0], [0, 1, 0, 0]], np.float32)
    out = check_train(TOK, LEN, f, f, mask, LIMITS)
    assert [x.shape for x in out[2:]] == [(2, 4)] * 3
    assert "returns has shape [2, 3]" in _err(check_train, TOK, LEN, f[:, :3], f, mask, LIMITS)
    assert "mask must hold only 0 and 1" in _err(check_train, TOK, LEN, f, f, mask * 0.5, LIMITS)
    beyond = mask.copy()
    beyond[1, 3] = 1
    assert "mask[1, 3] is 1 but lengths[1]=2" in _err(check_train, TOK, LEN, f, f, beyond, LIMITS)
    nan = f.copy()
    nan[0, 1] = np.nan
    assert "returns[0, 1] is nan" in _err(check_train, TOK, LEN, nan, f, mask, LIMITS)
    nan_outside = f.copy()
    nan_outside[0, 3] = np.nan  # not under the mask: allowed
    check_train(TOK, LEN, nan_outside, f, mask, LIMITS)
    big = np.zeros((7, 4), np.int64)
    assert "exceeds server.max_train_batch_size=6" in _err(
        check_train, big, np.ones(7), np.zeros((7, 4)), np.zeros((7, 4)), np.zeros((7, 4)), LIMITS
    )
    assert check_step(np.array([3])) == 3
    assert "must be one integer in 0..2^40" in _err(check_step, -1)
    assert "must be one integer in 0..2^40" in _err(check_step, 2**62)  # an absurd step never becomes "latest"
    assert check_step(-1, allow_fresh=True) == -1


def test_dp_rows_cover_batch_evenly():
    for batch in range(0, 9):
        for dp in (1, 2, 3):
            spans = [dp_rows(batch, dp, r) for r in range(dp)]
            assert spans[0][0] == 0 and spans[-1][1] == batch
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            sizes = [b - a for a, b in spans]
            assert max(sizes) - min(sizes) <= 1


# -- config ----------------------------------------------------------------------------------------------
def test_demo_and_base_configs_load():
    demo = load_critic_config(["--config-name", "ppo_critic_demo", "server.port=6001", "server.host=node7"])
    assert demo.reward_model is None and demo.reward_fn == os.path.join(REPO, "conf", "demo", "reward.py:reward_fn")
    assert demo.tokenizer == os.path.join(REPO, "conf", "demo", "tokenizer.json")
    assert (demo.server.host, demo.server.port) == ("node7", 6001)
    assert demo.server.resolved_ports() == {"HTTP": 6001, "gRPC": 6002, "metrics": 6003}
    assert (demo.model.hidden_size, demo.model.vocab_size, demo.model.num_query_groups) == (64, 48, 2)
    base = load_critic_config([])
    assert base.reward_model is not None and base.reward_fn is None and base.server.host == "127.0.0.1"


def _cfg(**kw) -> CriticJobConfig:
    kw.setdefault("model", tiny_model())
    return CriticJobConfig(**kw)


@pytest.mark.parametrize(
    "kw, key, text",
    [
        (dict(), "reward_model", "neither is set"),
        (dict(reward_model=tiny_model(), reward_fn="r.py", tokenizer="t.json"), "reward_model", "both are set"),
        (dict(reward_fn="r.txt", tokenizer="t.json"), "reward_fn", ".py"),
        (dict(reward_fn="r.py"), "tokenizer", "set tokenizer"),
        (dict(reward_model=tiny_model(vocab_size=50)), "reward_model.vocab_size", "50 != model.vocab_size=48"),
        (dict(reward_model=tiny_model(), reward_std=0.0), "reward_std", "> 0"),
    ],
)
def test_config_rules(kw, key, text):
    with pytest.raises(ConfigError) as info:
        _cfg(**kw).validate()
    assert info.value.key == key and text in str(info.value)


def test_config_server_and_world_rules():
    cfg = _cfg(reward_model=tiny_model())
    cfg.server.max_seq_len = 129
    with pytest.raises(ConfigError, match="server.max_seq_len"):
        cfg.validate()
    cfg.server.max_seq_len, cfg.server.grpc_port = None, cfg.server.port
    with pytest.raises(ConfigError, match="must differ"):
        cfg.validate()
    cfg.server.grpc_port = None
    cfg.validate()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 6, 4
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        cfg.validate_world(2)
    cfg.parallel.tensor_model_parallel_size = 3
    with pytest.raises(ConfigError, match="not divisible by TP=3"):
        cfg.validate_world(3)


def test_relative_paths_resolve_against_repo_and_config_dir(tmp_path):
    (tmp_path / "my_reward.py").write_text("def reward_fn(prompts, responses):\n    return [1.0] * len(prompts)\n")
    (tmp_path / "job.yaml").write_text(
        "defaults: []\nreward_fn: my_reward.py\ntokenizer: conf/demo/tokenizer.json\nmodel:\n  vocab_size: 48\n"
    )
    cfg = load_critic_config(["--config-path", str(tmp_path), "--config-name", "job"])
    assert cfg.reward_fn == f"{tmp_path / 'my_reward.py'}:reward_fn"  # next to the config file; the name explicit
    assert cfg.tokenizer == os.path.join(REPO, "conf", "demo", "tokenizer.json")  # under the repository root
    with pytest.raises(ConfigError) as info:
        load_critic_config(["--config-path", str(tmp_path), "--config-name", "job", "reward_fn=nope.py"])
    assert info.value.key == "reward_fn" and "'nope.py' not found" in str(info.value)


# -- reward function adapter -----------------------------------------------------------------------------
TOKENIZER = os.path.join(REPO, "conf", "demo", "tokenizer.json")


def _encode(text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(TOKENIZER).encode(text, add_special_tokens=False).ids  # pieces: no <bos>


def _reward_function(spec, workers=1, timeout_s=30.0, samples_per_call=1):
    return RewardFunction(str(spec), TOKENIZER, workers, timeout_s, samples_per_call)


def test_reward_function_decodes_prompt_and_response(tmp_path):
    fn = _reward_function(os.path.join(REPO, "conf", "demo", "reward.py"), workers=2)
    try:
        prompt, response = _encode("say a: cat:"), _encode("aab")
        row = prompt + response
        tokens = np.array([row + [0, 0], row[: len(prompt) + 1] + [0] * 4])
        lengths = np.array([len(row), len(prompt) + 1])
        prompts, responses = fn.texts(tokens, lengths, np.array([len(prompt)] * 2))
        assert prompts == ["say a: cat:"] * 2 and responses == ["aab", "a"]
        np.testing.assert_allclose(fn(tokens, lengths, np.array([len(prompt)] * 2), ["a", "b"]), [2 / 3, 0.0])
        # without prompt lengths the whole sequence is the response
        whole = fn(tokens, lengths)
        text = "say a: cat:aab"
        assert whole[0] == pytest.approx(text.count("a") / len(text))
    finally:
        fn.close()


@pytest.mark.parametrize(
    "body, text",
    [
        ("def reward_fn(p, r):\n    return []\n", "sample 0 of 2 (prompt '', response '"),
        ("def reward_fn(p, r):\n    return [float('nan')]\n", "sample 0 of 2 (prompt '', response 'bc'): returned nan"),
        # finite as a Python float, inf in float32 (the dtype rewards are used in)
        ("def reward_fn(p, r):\n    return [1e39]\n", "returned 1e+39, which is not a finite float32"),
        ("def reward_fn(p, r):\n    raise KeyError('boom')\n", "raised KeyError: 'boom'"),
        ("import sys\ndef reward_fn(p, r):\n    sys.exit(3)\n", "raised SystemExit: 3"),
        ("def reward_fn(p, r):\n    return 3\n", "returned 3, not a list of numbers"),
        ("import os\ndef reward_fn(p, r):\n    os._exit(7)\n", "exited with code 7"),
    ],
)
def test_reward_function_errors_name_the_file_and_the_sample(tmp_path, body, text):
    """The critic's reward function runs in worker processes (aligner.rewards.pool): whatever it does, the critic
    process gets a RewardFunctionError naming the function and the sample, and stays up."""
    path = tmp_path / "bad.py"
    path.write_text(body)
    fn = _reward_function(path)
    try:
        with pytest.raises(RewardFunctionError) as info:
            fn(np.array([[5, 6], [7, 8]]), np.array([2, 2]), np.array([0, 0]))
        assert text in str(info.value) and str(path) in str(info.value), str(info.value)
    finally:
        fn.close()


def test_a_hung_reward_function_is_stopped_and_named(tmp_path):
    path = tmp_path / "slow.py"
    path.write_text("import time\ndef reward_fn(p, r):\n    time.sleep(600 if r[0] == 'a' else 0)\n    return [1.0]\n")
    fn = _reward_function(path, workers=2, timeout_s=1.0)
    try:
        a, b = _encode("a"), _encode("b")
        with pytest.raises(RewardFunctionError, match=r"sample 0 of 2 .* no answer within reward_fn_timeout=1 s"):
            fn(np.array([a, b]), np.array([1, 1]), np.array([0, 0]))
        # the worker was replaced: the next request is answered
        np.testing.assert_array_equal(fn(np.array([b, b]), np.array([1, 1]), np.array([0, 0])), [1.0, 1.0])
    finally:
        fn.close()


def test_reward_function_named_in_the_spec(tmp_path):
    """`path.py:name`, as the actor's reward.fn: the same loader (aligner.rewards.function); errors name the spec."""
    path = tmp_path / "judge.py"
    path.write_text("def judge(p, r):\n    return [0.5] * len(p)\n\ndef broken(p, r):\n    return [1e39]\n")
    good, broken = _reward_function(f"{path}:judge"), _reward_function(f"{path}:broken")
    try:
        np.testing.assert_array_equal(good(np.array([[5, 6]]), np.array([2])), [0.5])
        with pytest.raises(RewardFunctionError, match=f"{path}:broken failed on sample 0"):
            broken(np.array([[5, 6], [7, 8]]), np.array([2, 2]))
    finally:
        good.close()
        broken.close()


def test_reward_function_file_without_reward_fn(tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    with pytest.raises(RewardFunctionError, match="defines no callable"):
        _reward_function(path)


# -- client ----------------------------------------------------------------------------------------------
def test_client_unreachable_error_names_url_and_what_to_check():
    from aligner.critic import CriticClient, CriticUnreachableError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    client = CriticClient(f"127.0.0.1:{port}", connect_timeout=1.5)
    start = time.monotonic()
    future = client.infer_async(TOK, LEN)  # returns at once
    with pytest.raises(CriticUnreachableError) as info:
        future.result(timeout=60)
    assert time.monotonic() - start < 30
    message = str(info.value)
    for part in (
        f"http://127.0.0.1:{port}",
        "within 1.5 s",
        "critic server ready",
        "server.host:server.port",
        "`critic` section",
    ):
        assert part in message, message
    with pytest.raises(CriticRequestError, match="empty batch"):  # checked locally, before any network
        client.infer_async(TOK[:0], LEN[:0])
    client.close()


def test_what_the_actor_sees_of_a_failed_request():
    """The critic's own errors reach the actor by class name and message; any other error by its class name only (the
    traceback stays in the critic's log), out of GPU memory with the critic's settings that take less."""
    import torch

    from aligner.critic.server import _reply

    bad = _reply(CriticRequestError("tokens: 3 rows, lengths: 2"))
    assert type(bad).__name__ == "CriticRequestError" and str(bad) == "tokens: 3 rows, lengths: 2"
    other = _reply(KeyError("values"))
    assert str(other) == "the critic job failed on this request (KeyError); see its log"
    oom = _reply(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    assert str(oom) == (
        "the critic job failed on this request (OutOfMemoryError: lower its train.micro_batch_size or "
        "infer.micro_batch_size, or give it GPUs of its own); see its log"
    )
