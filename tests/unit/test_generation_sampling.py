"""Sampling maths of the native engine and the generation config/params validation (pure tensors, no megatron)."""

import math

import pytest
import torch
from generation_reference import candidate_mask

from aligner.config.errors import ConfigError
from aligner.generation import GenerationConfig, SamplingParams, validate_generation
from aligner.generation.native.sampling import (
    choose_and_record,
    gumbel_noise,
    keys_for_seeds,
    sample_tokens,
    select_tokens,
    token_logprobs,
    uniforms_for_seeds,
)


def _logits_of(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float().unsqueeze(0)


def test_logprobs_are_temperature_scaled_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 11) * 3
    tokens = torch.randint(0, 11, (5,))
    for t in (1.0, 0.6, 1.7):
        expected = torch.log_softmax(logits.double() / t, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(token_logprobs(logits, tokens, t).double(), expected, rtol=0, atol=1e-6)
    # a 0-d tensor temperature (what the CUDA graph reads) gives the same numbers
    torch.testing.assert_close(token_logprobs(logits, tokens, torch.tensor(0.6)), token_logprobs(logits, tokens, 0.6))


def test_greedy_is_argmax_and_respects_bans():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 4.9]])
    assert sample_tokens(logits, None, greedy=True, temperature=0.3).tolist() == [1, 0]
    banned = torch.tensor([False, True, False, False])
    assert sample_tokens(logits, None, greedy=True, temperature=1.0, banned_BV=banned).tolist() == [2, 0]


def test_top_p_keeps_smallest_set_reaching_p():
    logits = _logits_of([0.5, 0.3, 0.15, 0.05])
    # mass before each token: 0, .5, .8, .95 -> keep while below top_p
    assert candidate_mask(logits, 1.0, 0, 0.8)[0].tolist() == [True, True, False, False]
    assert candidate_mask(logits, 1.0, 0, 0.81)[0].tolist() == [True, True, True, False]
    assert candidate_mask(logits, 1.0, 0, 0.01)[0].tolist() == [True, False, False, False]  # top-1 always stays
    assert candidate_mask(logits, 1.0, 2, None)[0].tolist() == [True, True, False, False]
    # top-k first, then top-p over the renormalised top-k: .5/.8=.625 before token 1
    assert candidate_mask(logits, 1.0, 3, 0.6)[0].tolist() == [True, True, False, False]


def test_inverse_cdf_hits_the_expected_tokens():
    logits = _logits_of([0.5, 0.3, 0.15, 0.05]).expand(4, 4)
    u = torch.tensor([0.0, 0.49, 0.51, 0.999])
    assert sample_tokens(logits, u, greedy=False, temperature=1.0).tolist() == [0, 0, 1, 3]
    # with top_p=0.8 the nucleus {0, 1} renormalises to (.625, .375)
    u = torch.tensor([0.0, 0.62, 0.63, 0.999])
    assert sample_tokens(logits, u, greedy=False, temperature=1.0, top_p=torch.tensor(0.8)).tolist() == [0, 0, 1, 1]
    # top_k=3: (.5, .3, .15)/.95
    u = torch.tensor([0.0, 0.52, 0.53, 0.999])
    assert sample_tokens(logits, u, greedy=False, temperature=1.0, top_k=3).tolist() == [0, 0, 1, 2]


@pytest.mark.parametrize("top_k,top_p", [(0, None), (5, None), (0, 0.7), (6, 0.9)])
def test_draws_stay_inside_the_mask_and_follow_its_distribution(top_k, top_p):
    torch.manual_seed(1)
    V, n = 12, 20000
    logits = (torch.randn(1, V) * 1.5).expand(n, V)
    temperature = 0.8
    banned = torch.zeros(V, dtype=torch.bool)
    banned[3] = True
    u = torch.rand(n)
    tokens = sample_tokens(
        logits,
        u,
        greedy=False,
        temperature=temperature,
        top_k=top_k,
        top_p=None if top_p is None else torch.tensor(top_p),
        banned_BV=banned,
    )
    allowed = candidate_mask(logits[:1].masked_fill(banned, float("-inf")), temperature, top_k, top_p)[0] & ~banned
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[~allowed].sum() == 0, "a token outside top-k/top-p or a banned token was drawn"
    probs = torch.softmax(logits[0].double() / temperature, -1) * allowed
    expected = probs / probs.sum()
    # the standard error of a frequency is at most 0.5/sqrt(n) = 0.0035: 5 of them is a loose but failing bound
    assert (counts / n - expected).abs().max() < 0.018


def test_gumbel_race_draws_follow_softmax_and_depend_only_on_key_step_and_token():
    """Plain sampling (select_tokens without top-k/top-p): argmax(logits / T + g) with the hashed Gumbel noise draws
    each token with its softmax probability, never a banned token; the noise of a sample depends on its key, the
    step and the token only, and successive steps of one key draw independently."""
    V, n = 12, 40000
    logits = (torch.randn(1, V, generator=torch.Generator().manual_seed(2)) * 1.5).expand(n, V).contiguous()
    end = torch.zeros(V, dtype=torch.bool)
    end[3] = True
    state = dict(
        logits_BV=logits, vocab_size=V, temperature=torch.tensor(0.8), u_BR=torch.zeros(n, 4),
        key_B=keys_for_seeds(range(1000, 1000 + n)), step_t=torch.tensor([1]), min_new_t=torch.tensor([5]),
        top_p=torch.tensor(1.0), end_mask_V=end, ended_B=torch.zeros(n, dtype=torch.bool), pad_t=torch.tensor(0),
    )  # fmt: skip
    tokens, logp, _, _ = select_tokens(**state, greedy=False, top_k=0, use_top_p=False)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[3] == 0, "a banned token was drawn"
    probs = torch.softmax(logits[0].double() / 0.8, -1).masked_fill(end, 0.0)
    expected = probs / probs.sum()
    assert (counts / n - expected).abs().max() < 0.0125  # 5 standard errors of a frequency (at most 0.0025)
    torch.testing.assert_close(logp, token_logprobs(logits, tokens, torch.tensor(0.8)))
    # the next step of the same keys: independent of this one (joint frequencies = products of the marginals)
    state["step_t"] = torch.tensor([2])
    again, _, _, _ = select_tokens(**state, greedy=False, top_k=0, use_top_p=False)
    first, second = tokens == int(expected.argmax()), again == int(expected.argmax())
    p1, p2 = first.double().mean(), second.double().mean()
    assert abs((first & second).double().mean() - p1 * p2) < 0.0125 and not torch.equal(tokens, again)
    # a sample's noise: its own key, step and token; other rows and the vocabulary's size change nothing
    keys = keys_for_seeds([5, 6, 2**63 + 5])
    g = gumbel_noise(keys, torch.tensor([3]), V)
    assert torch.equal(gumbel_noise(keys[[2, 0]], torch.tensor([3]), V + 4)[:, :V], g[[2, 0]])
    assert not torch.equal(g[0], g[2]) and not torch.equal(g[0], gumbel_noise(keys, torch.tensor([4]), V)[0])
    # standard Gumbel over many draws: mean = Euler's constant, variance = pi^2 / 6
    many = gumbel_noise(keys_for_seeds(range(2000)), torch.tensor([0]), 500).double()
    assert abs(many.mean() - 0.5772) < 0.01 and abs(many.var() - math.pi**2 / 6) < 0.03


def test_uniforms_depend_only_on_the_seed():
    a = uniforms_for_seeds([7, 8, 9], 6)
    b = uniforms_for_seeds([9, 7], 6)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1])
    assert a.min() >= 0 and a.max() < 1 and a.dtype == torch.float32


def test_sampling_params_validation_and_end_tokens():
    sp = SamplingParams(eos_token_id=2, stop_token_ids=[5, 2])
    assert sp.end_token_ids() == [2, 5]
    assert SamplingParams(eos_token_id=[3, 1], ignore_eos=True, stop_token_ids=[4]).end_token_ids() == []
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0).validate(1, 10, 8)
    SamplingParams(greedy=True, temperature=0.0).validate(1, 10, 8)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0).validate(1, 10, 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=9).validate(1, 10, 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams(eos_token_id=10).validate(1, 10, 8)
    with pytest.raises(ValueError, match="one per"):
        SamplingParams(seeds=[1, 2]).validate(3, 10, 8)


def test_generation_config_errors_name_the_key():
    validate_generation(GenerationConfig())
    with pytest.raises(ConfigError, match="generation.backend"):
        validate_generation(GenerationConfig(backend="vllm"))
    with pytest.raises(ConfigError, match="generation.max_batch_size"):
        validate_generation(GenerationConfig(max_batch_size=0))
    with pytest.raises(ConfigError, match="generation.decode_attention"):
        validate_generation(GenerationConfig(decode_attention="flashinfer"))

    class Gpt2:
        arch, max_position_embeddings = "gpt2", 300

    with pytest.raises(ConfigError, match="max_position_embeddings"):
        validate_generation(GenerationConfig(max_prompt_length=128, max_response_length=256), Gpt2())


def test_uniform_log_prob():
    lp = token_logprobs(torch.zeros(1, 4), torch.tensor([2]), 0.5)
    assert lp.item() == pytest.approx(-math.log(4), abs=1e-6)


def _step_state(B=6, V_pad=64, V=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    end = torch.zeros(V, dtype=torch.bool)
    end[[3, 7]] = True
    logits = torch.randn(B, V_pad, generator=g) * 2
    logits[0, 3] = 30.0  # sample 0 wants an end token; sample 1 already ended
    return dict(
        logits_BV=logits.bfloat16(),
        vocab_size=V,
        temperature=torch.tensor(0.8),
        u_BR=torch.rand(B, 5, generator=g),
        key_B=keys_for_seeds(range(seed * B, seed * B + B)),
        step_t=torch.tensor([2]),
        min_new_t=torch.tensor([0]),
        top_p=torch.tensor(0.9),
        end_mask_V=end,
        ended_B=torch.tensor([False, True] + [False] * (B - 2)),
        pad_t=torch.tensor(V - 1),
    )


def test_select_tokens_records_a_step():
    """The engine's step choice: padding columns never drawn, end tokens banned before min_new, ended samples get
    the pad token and log-prob 0, a drawn end token ends its sample."""
    state = _step_state()
    tok, logp, active, ended = select_tokens(**state, greedy=True, top_k=0, use_top_p=False)
    assert tok[0] == 3 and tok[1] == 59 and logp[1] == 0 and active.tolist() == [True, False] + [True] * 4
    assert ended.tolist() == [True, True] + [False] * 4
    scaled = state["logits_BV"][:, :60].float() / 0.8
    assert torch.equal(tok[2:], scaled[2:].argmax(-1))
    torch.testing.assert_close(logp[0], torch.log_softmax(scaled[0], -1)[3])
    state["min_new_t"] = torch.tensor([3])  # step 2 < 3: end tokens banned
    tok, _, _, ended = select_tokens(**state, greedy=True, top_k=0, use_top_p=False)
    assert tok[0] not in (3, 7) and ended.tolist() == [False, True] + [False] * 4


def _record_state(B=6, R=5, seed=0):
    """The engine's step state beside _step_state's inputs: outputs, lengths, current tokens and positions, as the
    engine passes them: the first B rows of buffers built for more."""
    g = torch.Generator().manual_seed(100 + seed)
    Bm = B + 2
    return dict(
        out_tokens_BR=torch.randint(0, 60, (Bm, R), generator=g)[:B],
        out_logp_BR=torch.randn(Bm, R, generator=g)[:B],
        lengths_B=torch.randint(0, 3, (Bm,), generator=g)[:B],
        cur_tok_B=torch.randint(0, 60, (Bm,), generator=g)[:B],
        pos_B=torch.randint(5, 9, (Bm,), generator=g)[:B],
    )


def test_choose_and_record_writes_the_step_into_the_state():
    """The decode step's choice and bookkeeping in one function: column step_t of the outputs gets the chosen
    tokens and log-probs (nothing else changes there), active samples count, ended samples stay ended, positions
    and the step counter advance by one."""
    state, record = _step_state(), _record_state()
    before = {k: v.clone() for k, v in {**state, **record}.items() if isinstance(v, torch.Tensor)}
    tok, logp, active, ended = select_tokens(**state, greedy=True, top_k=0, use_top_p=False)
    choose_and_record(**state, **record, greedy=True, top_k=0, use_top_p=False)
    assert torch.equal(record["out_tokens_BR"][:, 2], tok) and torch.equal(record["out_logp_BR"][:, 2], logp)
    others = [0, 1, 3, 4]
    assert torch.equal(record["out_tokens_BR"][:, others], before["out_tokens_BR"][:, others])
    assert torch.equal(record["out_logp_BR"][:, others], before["out_logp_BR"][:, others])
    assert torch.equal(record["lengths_B"], before["lengths_B"] + active)
    assert torch.equal(state["ended_B"], ended) and torch.equal(record["cur_tok_B"], tok)
    assert torch.equal(record["pos_B"], before["pos_B"] + 1) and state["step_t"].tolist() == [3]


@pytest.mark.parametrize(
    "mode", [(True, 0, False), (False, 0, False), (False, 8, False), (False, 0, True), (False, 8, True)]
)
def test_compiled_select_tokens_equals_eager(mode):
    """What the engine runs with compiled kernels (torch.compile of select_tokens; on CPU inductor needs a C++
    compiler): the same tokens and log-probs to float32 rounding, for each sampling mode."""
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    greedy, top_k, use_top_p = mode
    compiled = torch.compile(select_tokens, dynamic=False, fullgraph=True)
    for seed in range(3):
        state = _step_state(seed=seed)
        want = select_tokens(**state, greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        got = compiled(**state, greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    # what the engine compiles: the choice with the step's bookkeeping, its state written in place
    compiled = torch.compile(choose_and_record, dynamic=False, fullgraph=True)
    for seed in range(2):
        eager_state, eager_record = _step_state(seed=seed), _record_state(seed=seed)
        state, record = _step_state(seed=seed), _record_state(seed=seed)
        choose_and_record(**eager_state, **eager_record, greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        compiled(**state, **record, greedy=greedy, top_k=top_k, use_top_p=use_top_p)
        for name in ("step_t", "ended_B"):
            assert torch.equal(state[name], eager_state[name])
        for name, want in eager_record.items():
            torch.testing.assert_close(record[name], want, rtol=0, atol=1e-5)
