"""The actor's sequence layout (aligner/ppo/rollout.py), by hand."""

import pytest
import torch

from aligner.ppo.rollout import assemble, by_row, concat, micro_batches, pad_to, response_mask, sample_seeds


def test_layout_and_shifted_grid():
    prompts = torch.tensor([[5, 6, 0], [7, 8, 9]])
    prompt_lengths = torch.tensor([2, 3])
    responses = torch.tensor([[10, 11, 2], [12, 0, 0]])
    response_lengths = torch.tensor([3, 1])
    logprobs = torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]])
    r = assemble(
        prompts,
        prompt_lengths,
        responses,
        response_lengths,
        logprobs,
        torch.tensor([True, False]),
        pad_id=0,
        total_length=6,
    )
    assert r.tokens_BT.tolist() == [[5, 6, 10, 11, 2, 0], [7, 8, 9, 12, 0, 0]]
    assert r.lengths_B.tolist() == [5, 4]
    # shifted index i is token i+1: sample 0's response tokens 2..4 sit at 1..3, sample 1's token 3 at 2
    assert r.mask_BS.tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 0, 0]]
    torch.testing.assert_close(r.engine_logp_BS, torch.tensor([[0, -0.1, -0.2, -0.3, 0], [0, 0, -0.4, 0, 0]]))
    assert r.ended_B.tolist() == [True, False]


def test_response_mask_matches_assemble():
    m = response_mask(torch.tensor([1, 4]), torch.tensor([2, 0]), 5)
    assert m.tolist() == [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_concat_and_pad_keep_rows_aligned():
    def one(tokens, p, resp):
        return assemble(
            torch.tensor([tokens]),
            torch.tensor([p]),
            torch.tensor([resp]),
            torch.tensor([len(resp)]),
            torch.full((1, len(resp)), -1.0),
            torch.tensor([True]),
            0,
            p + len(resp),
        )

    a, b = one([1, 2], 2, [3]), one([4], 1, [5, 6, 7])
    a.positions, b.positions = [3], [0]
    c = concat([a, b], pad_id=0)
    assert c.tokens_BT.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]
    assert c.mask_BS.tolist() == [[0, 1, 0], [1, 1, 1]]
    assert c.positions == [3, 0]
    c = pad_to(c, 6, pad_id=0)
    assert c.tokens_BT.shape == (2, 6) and c.mask_BS.shape == (2, 5) and c.mask_BS.sum() == 4


def test_seeds_depend_on_position_not_batch():
    assert sample_seeds(1, 2, [5, 9])[1] == sample_seeds(1, 2, [9])[0]
    assert sample_seeds(1, 2, [5]) != sample_seeds(1, 3, [5]) != sample_seeds(2, 2, [5])


def test_minibatches_are_the_same_sets_for_any_dp():
    from aligner.ppo.rollout import minibatch_positions

    n, groups = 16, 2
    one = minibatch_positions(n, groups, 1, 0, seed=3)
    assert sorted(one) == list(range(n)) and one != list(range(n))
    two = [minibatch_positions(n, groups, 2, r, seed=3) for r in range(2)]
    for m in range(groups):  # global mini-batch m = union of the ranks' m-th local slices
        assert set(two[0][m * 4 : (m + 1) * 4]) | set(two[1][m * 4 : (m + 1) * 4]) == set(one[m * 8 : (m + 1) * 8])
    assert minibatch_positions(4, 1, 2, 1, None) == [2, 3]


def test_groups_stay_whole_on_a_rank_and_in_a_minibatch():
    """Prompts (groups) are dealt out, then expanded to their samples: every rank holds whole groups in each of its
    mini-batch slices, and the global mini-batches are the same sample sets for DP=1 and DP=2."""
    from aligner.ppo.rollout import expand_groups, minibatch_positions

    prompts, n, minis = 8, 3, 2
    assert expand_groups([2, 0], 3) == [6, 7, 8, 0, 1, 2]
    one = expand_groups(minibatch_positions(prompts, minis, 1, 0, seed=5), n)
    two = [expand_groups(minibatch_positions(prompts, minis, 2, r, seed=5), n) for r in range(2)]
    share = prompts // minis // 2 * n  # samples per rank per mini-batch
    for rows in two:
        for lo in range(0, len(rows), n):
            g = rows[lo] // n
            assert rows[lo : lo + n] == [g * n + j for j in range(n)], "a group's samples stay together, in order"
    for m in range(minis):
        union = set(two[0][m * share : (m + 1) * share]) | set(two[1][m * share : (m + 1) * share])
        assert union == set(one[m * 2 * share : (m + 1) * 2 * share])


def test_select_and_gather_rows_in_global_order():
    from aligner.ppo.rollout import gather_rollout, select_rows

    r = assemble(
        torch.tensor([[5, 6], [7, 0], [8, 9]]),
        torch.tensor([2, 1, 2]),
        torch.tensor([[1, 2], [3, 0], [4, 0]]),
        torch.tensor([2, 1, 1]),
        torch.zeros(3, 2),
        torch.tensor([True, False, True]),
        0,
        4,
    )
    r.labels, r.positions = ["a", "b", "c"], [4, 0, 2]
    sub = select_rows(r, [2, 0])
    assert sub.tokens_BT.tolist() == [[8, 9, 4, 0], [5, 6, 1, 2]] and sub.labels == ["c", "a"]
    assert sub.positions == [2, 4] and sub.ended_B.tolist() == [True, True]
    whole, scores = gather_rollout(r, torch.tensor([0.4, 0.0, 0.2]), None, 0)  # no group: this rank's rows
    assert whole.positions == [0, 2, 4] and scores.tolist() == pytest.approx([0.0, 0.2, 0.4])
    assert whole.labels == ["b", "c", "a"] and whole.tokens_BT.device.type == "cpu"


def _rollout_of_lengths(prompt_lengths, response_lengths, total):
    B = len(prompt_lengths)
    prompts = torch.arange(1, 1 + B * total).view(B, total) % 50 + 3
    responses = torch.arange(1, 1 + B * total).view(B, total) % 40 + 60
    return assemble(
        prompts,
        torch.tensor(prompt_lengths),
        responses,
        torch.tensor(response_lengths),
        -torch.rand(B, total),
        torch.ones(B, dtype=torch.bool),
        pad_id=0,
        total_length=total,
    )


def test_micro_batches_sorted_by_length_and_cut_to_their_longest_row():
    r = _rollout_of_lengths([2, 3, 2, 4, 1], [1, 9, 3, 2, 5], total=12)  # lengths 3, 12, 5, 6, 6
    adv = torch.arange(5 * 11, dtype=torch.float32).view(5, 11)
    plain = micro_batches(r, None, 2, 0, advantages=adv)
    assert [mb["rows"].tolist() for mb in plain] == [[0, 1], [2, 3], [4]]
    assert all(mb["tokens"].shape[1] == 12 and mb["mask"].shape[1] == 11 for mb in plain)
    trimmed = micro_batches(r, None, 2, 4, advantages=adv)
    # longest first, ties in their order: 1 (12), 3 (6), 4 (6), 2 (5), 0 (3); widths rounded up to 4, at most 12
    assert [mb["rows"].tolist() for mb in trimmed] == [[1, 3], [4, 2], [0]]
    assert [mb["tokens"].shape[1] for mb in trimmed] == [12, 8, 4]
    for mb in trimmed:
        w = mb["tokens"].shape[1]
        assert torch.equal(mb["tokens"], r.tokens_BT[mb["rows"], :w])
        assert torch.equal(mb["advantages"], adv[mb["rows"], : w - 1]) and mb["mask"].shape[1] == w - 1
        # nothing cut off is a response token or a real token
        assert r.mask_BS[mb["rows"], w - 1 :].sum() == 0 and (r.tokens_BT[mb["rows"], w:] == 0).all()
    # a subset of rows (a mini-batch) is sorted within itself
    assert [mb["rows"].tolist() for mb in micro_batches(r, [0, 2, 4], 3, 4)] == [[4, 2, 0]]


def test_by_row_puts_results_back_in_rollout_order():
    r = _rollout_of_lengths([2, 3, 2, 4, 1], [1, 9, 3, 2, 5], total=12)
    micro = micro_batches(r, None, 2, 4)
    parts = [mb["tokens"][:, 1:].float() for mb in micro]  # a per-token result on each micro-batch's width
    out = by_row(micro, parts, 5, 11)
    expected = r.tokens_BT[:, 1:].float() * (torch.arange(11) < torch.tensor([[3], [11], [7], [11], [7]]))
    assert torch.equal(out, expected)
