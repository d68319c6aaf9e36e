"""Sequence packing: bins, row layout, the block-diagonal causal mask, and the claim that matters: a packed sample's
logits equal its logits alone (attention does not leak across samples), for RoPE (llama) and learned positions
(gpt2), through SDPA with the dense mask or the samples' starts (`Segments`) and megatron's unfused attention."""

import numpy as np
import pytest
import torch
from dist import run_ranks

from aligner.data.packing import (
    attention_mask_from_segments,
    collate,
    length_buckets,
    pack,
    packed_row,
    plain_row,
    segment_starts,
    trimmed_groups,
)
from aligner.data.supervised import Sample


def _sample(ids, first_target):
    ids = np.asarray(ids, dtype=np.int64)
    targets = np.arange(len(ids)) >= first_target
    return Sample(ids, targets)


def test_pack_first_fit_decreasing_respects_capacity():
    lengths = [5, 9, 3, 7, 2, 4]
    bins = pack(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert bins == [[1], [3, 2], [0, 5], [4]]  # 9 | 7+3 | 5+4 | 2 (one token free in bins 0 and 2: too little)
    with pytest.raises(ValueError, match="does not fit"):
        pack([11], 10)


def test_length_buckets_group_similar_lengths():
    assert length_buckets([3, 9, 1, 7, 5], 2) == [[1, 3], [4, 0], [2]]


def test_trimmed_groups_cut_each_micro_batch_to_its_longest_row():
    lengths = [3, 9, 1, 7, 5]
    assert trimmed_groups(lengths, 2, 0, 12) == [([0, 1], 12), ([2, 3], 12), ([4], 12)]  # off: in order, whole
    assert trimmed_groups(lengths, 2, 4, 12) == [([1, 3], 12), ([4, 0], 8), ([2], 4)]  # 9 -> 12, 5 -> 8, 1 -> 4
    assert trimmed_groups(lengths, 2, 4, 10) == [([1, 3], 10), ([4, 0], 8), ([2], 4)]  # never past the width
    assert trimmed_groups(lengths, 2, 1, 12) == [([1, 3], 9), ([4, 0], 5), ([2], 1)]

    # By tokens: as many rows as fit at the micro-batch's (first, longest) row's width; at least one.
    assert trimmed_groups(lengths, 99, 4, 12, max_tokens=16) == [([1], 12), ([3, 4], 8), ([0, 2], 4)]
    assert trimmed_groups(lengths, 99, 1, 12, max_tokens=5) == [([1], 9), ([3], 7), ([4], 5), ([0], 3), ([2], 1)]
    assert trimmed_groups(lengths, 99, 0, 12, max_tokens=30) == [([0, 1], 12), ([2, 3], 12), ([4], 12)]


def test_packed_row_restarts_positions_and_keeps_targets_per_sample():
    a, b = _sample([1, 10, 11, 12], 2), _sample([1, 20, 21], 1)
    row = packed_row([a, b])
    assert row["tokens"].tolist() == [1, 10, 11, 12, 1, 20, 21]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row["segment_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    # b's first token (its BOS) is never a target, even though it follows a's last token in the row
    assert row["targets"].tolist() == [False, False, True, True, False, True, True]
    batch = collate([row], 9, pad_id=0)
    assert batch["tokens"][0].tolist() == [1, 10, 11, 12, 1, 20, 21, 0, 0]
    assert not batch["targets"][0, 7:].any()


def test_attention_mask_is_causal_within_segments_only():
    mask = attention_mask_from_segments(torch.tensor([[0, 0, 1, 1, 1, -1]]))[0, 0]
    allowed = (~mask).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding attends to itself: no empty softmax row (NaN)
    ]


def test_plain_rows_have_no_mask_or_positions():
    batch = collate([plain_row(_sample([1, 2, 3], 1))], 4, pad_id=0)
    assert set(batch) == {"tokens", "targets"}


def test_segment_starts_cover_each_sample_and_each_rows_padding():
    ids = torch.tensor([[0] * 7 + [1] * 12 + [-1] * 3, [0] * 5 + [1] * 9 + [-1] * 8])
    starts, longest = segment_starts(ids)
    assert starts.dtype == torch.int32
    assert starts.tolist() == [0, 7, 19, 22, 27, 36, 44] and longest == 12
    # a row with no padding: the next row's first sample, id 0 like this row's first, is still a new segment
    starts, longest = segment_starts(torch.tensor([[0, 0, 1], [0, 0, 0]]))
    assert starts.tolist() == [0, 2, 3, 6] and longest == 3


def test_collate_without_the_mask_keeps_the_segments():
    rows = [packed_row([_sample([5, 6, 7], 1), _sample([8, 9], 1)])]
    with_mask, without = collate(rows, 7, pad_id=0), collate(rows, 7, pad_id=0, mask=False)
    assert "attention_mask" not in without and set(with_mask) == set(without) | {"attention_mask"}
    assert without["segment_ids"].tolist() == [[0, 0, 0, 1, 1, -1, -1]]
    assert torch.equal(with_mask["attention_mask"], attention_mask_from_segments(without["segment_ids"]))


def _model(arch, backend):
    from aligner.config import ModelConfig
    from aligner.models.gpt import build_gpt

    extra = {"arch": "gpt2", "num_query_groups": None} if arch == "gpt2" else {"num_query_groups": 2}
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        vocab_size=48,
        make_vocab_size_divisible_by=16,
        max_position_embeddings=64,
        attention_backend=backend,
        **extra,
    )
    return build_gpt(cfg)


def _packed_vs_alone(rank, world, arch, backend):
    from aligner.models.attention import Segments
    from aligner.parallel import initialize

    initialize(seed=5)
    model = _model(arch, "sdpa" if backend == "varlen" else backend).eval()
    g = torch.Generator().manual_seed(0)
    samples = [_sample(torch.randint(4, 48, (n,), generator=g).numpy(), 1) for n in (7, 12, 5, 9)]
    rows = [packed_row(samples[:2]), packed_row(samples[2:])]
    batch = collate(rows, 22, pad_id=0, mask=backend != "varlen")
    segments = Segments.of(batch["segment_ids"]) if backend == "varlen" else None
    with torch.no_grad():
        packed = model(
            batch["tokens"],
            batch["position_ids"],
            attention_mask=batch.get("attention_mask"),
            packed_seq_params=segments,
        )
        alone = []
        for s in samples:
            t = torch.from_numpy(s.ids).unsqueeze(0)
            alone.append(model(t, torch.arange(t.shape[1]).unsqueeze(0), attention_mask=None)[0])
    out = []
    for r, (first, second) in enumerate(((0, 1), (2, 3))):
        n = len(samples[first])
        out.append((packed[r, :n], alone[first]))
        out.append((packed[r, n : n + len(samples[second])], alone[second]))
    return out


@pytest.mark.parametrize(
    "arch, backend",
    [("llama", "sdpa"), ("llama", "unfused"), ("gpt2", "sdpa"), ("llama", "varlen"), ("gpt2", "varlen")],
)
def test_packed_logits_equal_each_sample_alone(arch, backend):
    for packed, alone in run_ranks(_packed_vs_alone, 1, arch, backend)[0]:
        torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


def test_segment_ids_stay_on_the_cpu_and_starts_go_to_the_device():
    """A micro-batch moved to a device keeps `segment_ids` on the CPU, where `Segments.of` finds the starts without
    reading anything back from the device, then hands them over ("meta" stands in for a GPU here)."""
    from aligner.models.attention import Segments

    samples = [_sample(np.arange(4, 4 + n), 1) for n in (3, 5, 2)]
    batch = collate([packed_row(samples[:2]), packed_row(samples[2:])], 9, pad_id=0, device="meta", mask=False)
    assert batch["segment_ids"].device.type == "cpu"
    assert all(v.device.type == "meta" for k, v in batch.items() if k != "segment_ids")
    segments = Segments.of(batch["segment_ids"], device="meta")
    assert segments.cu_seqlens_q.device.type == "meta" and segments.cu_seqlens_q.dtype == torch.int32
    assert (segments.longest, segments.tokens) == (7, 18)  # row 2: a sample of 2, then padding of 7
    assert Segments.of(batch["segment_ids"]).cu_seqlens_q.tolist() == [0, 3, 8, 9, 11, 18]


def _mask_vs_segments_gradients(rank, world):
    """The same packed micro-batch through the dense mask and through `Segments`: loss and every gradient."""
    from aligner.models.attention import Segments
    from aligner.parallel import initialize

    initialize(seed=5)
    model = _model("llama", "sdpa").train()
    g = torch.Generator().manual_seed(1)
    samples = [_sample(torch.randint(4, 48, (n,), generator=g).numpy(), 1) for n in (3, 11, 6, 1, 8, 13)]
    rows = [packed_row(samples[:3]), packed_row(samples[3:])]
    batch = collate(rows, 24, pad_id=0)
    segments = Segments.of(batch["segment_ids"])
    out = {}
    for name, kwargs in (
        ("mask", {"attention_mask": batch["attention_mask"]}),
        ("segments", {"attention_mask": None, "packed_seq_params": segments}),
    ):
        model.zero_grad()
        logits = model(batch["tokens"], batch["position_ids"], **kwargs)
        loss = (logits.log_softmax(-1)[..., 7] * batch["targets"]).sum()
        loss.backward()
        out[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def test_segments_give_the_masks_loss_and_gradients():
    out = run_ranks(_mask_vs_segments_gradients, 1)[0]
    (loss_m, grads_m), (loss_s, grads_s) = out["mask"], out["segments"]
    torch.testing.assert_close(loss_s, loss_m, rtol=1e-5, atol=1e-5)
    assert grads_m.keys() == grads_s.keys() and len(grads_m) > 5
    for name, grad in grads_m.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads_s[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_the_varlen_check_passes_attention_by_segments_and_names_a_wrong_one(monkeypatch):
    from aligner.models import attention

    assert attention.varlen_check("cpu", torch.float32) is None
    assert attention.varlen_check("cpu", torch.bfloat16) is None
    real = attention.segment_attention

    def one_segment(q, k, v, starts, longest, scale, dropout=0.0):  # attention across the samples
        return real(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32), q.shape[0], scale, dropout)

    monkeypatch.setattr(attention, "segment_attention", one_segment)
    assert attention.varlen_check("cpu", torch.float32).startswith("output differs by")

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(attention, "segment_attention", no_kernel)
    assert attention.varlen_check("cpu", torch.float32) == "RuntimeError: no kernel image is available"


def test_the_sft_trainer_takes_varlen_where_the_flash_kernel_passes_its_check(monkeypatch, caplog):
    import logging

    from aligner.config import ConfigError
    from aligner.config.sft import load_sft_config
    from aligner.train import sft

    def choice(*overrides):
        return sft.packed_attention(load_sft_config(["--config-name=sft_demo", *overrides]))

    assert choice() == "mask"  # the CPU: no flash kernel
    assert choice("data.packed_attention=varlen") == "varlen"  # SDPA one sample at a time
    monkeypatch.setattr(sft, "on_gpu", lambda: True)  # a GPU, as far as the choice can tell; the check runs here
    monkeypatch.setattr(sft, "current_device", lambda: torch.device("cpu"))
    bf16 = "model.params_dtype=bfloat16"
    assert choice() == "mask"  # float32 parameters: no flash kernel
    assert choice(bf16) == "varlen"
    assert choice(bf16, "model.attention_backend=unfused") == "mask"
    monkeypatch.setattr(sft, "varlen_check", lambda device, dtype: "RuntimeError: no kernel image is available")
    with caplog.at_level(logging.WARNING):
        assert choice(bf16) == "mask"
    assert "failed its check (RuntimeError: no kernel image is available)" in caplog.text
    with pytest.raises(ConfigError, match="data.packed_attention.*no kernel image.*set mask"):
        choice(bf16, "data.packed_attention=varlen")
