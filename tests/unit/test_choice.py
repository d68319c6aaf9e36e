"""The decode step's token choice in two Triton kernels (aligner.generation.native.choice) under Triton's
interpreter (tests/conftest.py), against sampling.choose_and_record, the function it replaces: the same tokens, the
same state updates, log-probs to float32 rounding, for greedy choice and plain sampling, the vocabulary in one
chunk and in several (ties across chunks go to the first index, as torch's argmax)."""

import pytest
import torch

from aligner.generation.native.sampling import choose_and_record, keys_for_seeds

pytest.importorskip("triton")

from aligner.generation.native import choice  # noqa: E402


def _state(B, V, V_pad, seed, step=2, min_new=0):
    g = torch.Generator().manual_seed(seed)
    end = torch.zeros(V, dtype=torch.bool)
    end[[3, V - 5]] = True
    logits = (torch.randn(B, V_pad, generator=g) * 3).bfloat16()
    logits[0, 3] = 30.0  # sample 0 wants an end token; sample 1 already ended
    logits[2, V // 3] = logits[2, V - 2] = 40.0  # a tie across chunks: the first index wins
    state = dict(
        logits_BV=logits,
        vocab_size=V,
        temperature=torch.tensor(0.7),
        u_BR=torch.rand(B, 5, generator=g),
        key_B=keys_for_seeds(range(seed * B, seed * B + B)),
        step_t=torch.tensor([step]),
        min_new_t=torch.tensor([min_new]),
        top_p=torch.tensor(1.0),
        end_mask_V=end,
        ended_B=torch.tensor([False, True] + [False] * (B - 2)),
        pad_t=torch.tensor(V - 1),
    )
    Bm, R = B + 2, 5  # the engine's buffers are built for more rows: their first B rows
    record = dict(
        out_tokens_BR=torch.randint(0, V, (Bm, R), generator=g)[:B],
        out_logp_BR=torch.randn(Bm, R, generator=g)[:B],
        lengths_B=torch.randint(0, 3, (Bm,), generator=g)[:B],
        cur_tok_B=torch.randint(0, V, (Bm,), generator=g)[:B],
        pos_B=torch.randint(5, 9, (Bm,), generator=g)[:B],
    )
    return state, record


def _both(greedy, B, V, V_pad, seed, **kw):
    want_state, want_record = _state(B, V, V_pad, seed, **kw)
    got_state, got_record = _state(B, V, V_pad, seed, **kw)
    choose_and_record(**want_state, **want_record, greedy=greedy, top_k=0, use_top_p=False)
    choice.choose_and_record(**got_state, **got_record, greedy=greedy, top_k=0, use_top_p=False)
    return (want_state, want_record), (got_state, got_record)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "B, V, V_pad, block",
    [(6, 60, 64, 16), (3, 10000, 10016, None), (130, 40, 48, 64)],
    ids=["4-chunks", "2-chunks-8192", "130-rows"],  # the last: one chunk, the merge's rows in two steps
)
def test_the_kernels_record_what_the_function_records(greedy, B, V, V_pad, block, monkeypatch):
    if block is not None:  # narrow inner steps: several chunks from a small vocabulary
        monkeypatch.setattr(choice, "BLOCK", block)
    S = -(-V // choice.BLOCK)
    assert (S > 1 or B > choice.MERGE_ROWS) and V % choice.BLOCK  # several chunks (the last one part-filled)
    for seed in range(2):
        for min_new in (0, 5):  # end tokens allowed, then banned (step 2 < 5)
            (want_state, want), (got_state, got) = _both(greedy, B, V, V_pad, seed, min_new=min_new)
            step = 2
            assert torch.equal(got["out_tokens_BR"], want["out_tokens_BR"])
            torch.testing.assert_close(got["out_logp_BR"], want["out_logp_BR"], rtol=0, atol=2e-5)
            for name in ("lengths_B", "cur_tok_B", "pos_B"):
                assert torch.equal(got[name], want[name]), name
            for name in ("ended_B", "step_t"):
                assert torch.equal(got_state[name], want_state[name]), name
            tokens = got["out_tokens_BR"][:, step]
            assert tokens[1] == V - 1 and got["out_logp_BR"][1, step] == 0  # ended: the pad token, log-prob 0
            if greedy:
                assert tokens[2] == V // 3  # the tie's first index
                assert tokens[0] == (3 if min_new == 0 else tokens[0]) and (min_new == 0 or tokens[0] != 3)


def test_sampled_tokens_follow_the_noise_of_the_step():
    """The draws are a function of (key, step, token): another step draws other tokens, the same step the same."""
    (_, a), (_, b) = _both(False, 64, 500, 512, 0)
    state, record = _state(64, 500, 512, 0, step=3)
    choice.choose_and_record(**state, **record, greedy=False, top_k=0, use_top_p=False)
    assert torch.equal(a["out_tokens_BR"], b["out_tokens_BR"])
    assert (record["out_tokens_BR"][:, 3] != b["out_tokens_BR"][:, 2]).float().mean() > 0.5


def test_top_k_and_top_p_are_refused():
    state, record = _state(4, 60, 64, 0)
    for top_k, use_top_p in ((8, False), (0, True)):
        with pytest.raises(ValueError, match="greedy or plain sampling only"):
            choice.choose_and_record(**state, **record, greedy=False, top_k=top_k, use_top_p=use_top_p)
