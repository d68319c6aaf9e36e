"""The Triton decode attention kernel (aligner.generation.native.triton_decode) under Triton's interpreter on the CPU
(tests/conftest.py turns it on): against plain attention over each sample's first pos_b + 1 slots, for GQA group
sizes 1-3, power-of-two and other head widths, one and several slot ranges (the split path and its merge), float32
and bfloat16. The engine's greedy decoding with it is checked in test_generation_engine.py; its speed on a GPU in
docs/PERF.md."""

import pytest
import torch

pytest.importorskip("triton")

from aligner.generation.native.triton_decode import decode_attention  # noqa: E402


def _reference(q, keys, values, pos, scale):
    T = keys.shape[2]
    scores = torch.einsum("bgrd,bgtd->bgrt", q.float(), keys.float()) * scale
    beyond = torch.arange(T)[None, None, None, :] > pos[:, None, None, None]
    probs = scores.masked_fill(beyond, float("-inf")).softmax(-1)
    return torch.einsum("bgrt,bgtd->bgrd", probs, values.float())


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,G,r,D,T", [(3, 2, 2, 64, 50), (2, 1, 3, 24, 70), (2, 3, 1, 16, 33)])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_plain_attention_over_the_filled_slots(dtype, atol, B, G, r, D, T, splits):
    g = torch.Generator().manual_seed(B * 100 + T)
    # q as the engine passes it: a strided view (the group's rows of the RoPE output, key and value rows after them)
    q = torch.randn(B, G, r + 2, D, generator=g).to(dtype)[:, :, :r]
    # keys and values as views into a larger cache (more rows and slots than this call's)
    cache = torch.randn(2, B + 1, G, T + 7, D, generator=g).to(dtype)
    keys, values = cache[0, :B, :, :T], cache[1, :B, :, :T]
    pos = torch.tensor([0, T - 1, T // 2][:B])
    scale = D**-0.5
    out = decode_attention(q, keys, values, pos, scale, splits=splits)
    assert out.shape == (B, G, r, D) and out.dtype == dtype
    torch.testing.assert_close(out.float(), _reference(q, keys, values, pos, scale), rtol=0, atol=atol)
    # slots past a sample's position are never read: garbage there changes nothing
    cache[:, :B, :, T // 2 + 1 :] = float("nan")
    cache[:, 1, :, :] = torch.randn(2, G, T + 7, D, generator=g).to(dtype)  # sample 1 reads all of its slots
    again = decode_attention(q, keys, values, pos, scale, splits=splits)
    assert torch.equal(again[0], out[0]) and torch.equal(again[2:], out[2:]) and not again.isnan().any()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,G,r,D,T", [(3, 2, 2, 64, 50), (3, 3, 1, 24, 33)])
@pytest.mark.parametrize("splits", [1, 3])
def test_the_steps_own_key_and_value_are_written_and_attended(dtype, atol, B, G, r, D, T, splits):
    """new_kv: the kernel writes the step's key and value into slot pos and attends to them, never reading that
    slot's old contents."""
    g = torch.Generator().manual_seed(B * 10 + T)
    q = torch.randn(B, G, r, D, generator=g).to(dtype)
    cache = torch.randn(2, B, G, T, D, generator=g).to(dtype)
    pos = torch.tensor([0, T - 1, T // 2][:B])
    kv_new = torch.randn(2, B, G, D, generator=g).to(dtype)
    rows = torch.arange(B)
    cache[:, rows, :, pos] = float("nan")  # what the slots held before: never read
    out = decode_attention(q, cache[0], cache[1], pos, D**-0.5, splits=splits, new_kv=(kv_new[0], kv_new[1]))
    assert torch.equal(cache[:, rows, :, pos], kv_new.transpose(0, 1))  # [B, 2, G, D]
    assert not cache.isnan().any()
    torch.testing.assert_close(out.float(), _reference(q, cache[0], cache[1], pos, D**-0.5), rtol=0, atol=atol)
    with pytest.raises(ValueError, match="new_kv needs the cache's dtype"):
        decode_attention(q, cache[0], cache[1], pos, 1.0, new_kv=(kv_new[0].double(), kv_new[1].double()))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,G,r,D,T", [(3, 2, 2, 64, 50), (3, 3, 1, 24, 33)])
@pytest.mark.parametrize("splits", [1, 3])
def test_rope_applied_by_the_kernel(dtype, atol, B, G, r, D, T, splits):
    """rope: q and the new key arrive un-rotated (views of the qkv projection's rows); the kernel rotates both as
    megatron does (t * cos + rotate_half(t) * sin, rounded once to the cache's dtype) and writes the rotated key."""
    g = torch.Generator().manual_seed(B * 7 + T)
    qkv = torch.randn(B, G, r + 2, D, generator=g).to(dtype)
    angles = torch.rand(B, D // 2, generator=g) * 6.0
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin_signed = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)

    def rotate(t):  # [B, G, n, D] in float32, as megatron's formula: t * cos + [-t2, t1] * sin
        t1, t2 = t.float().chunk(2, -1)
        sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype).float()
        return (t.float() * cos.float()[:, None, None] + torch.cat((-t2, t1), -1) * sin[:, None, None]).to(dtype)

    q_rot, k_rot = rotate(qkv[:, :, :r]), rotate(qkv[:, :, r : r + 1])[:, :, 0]
    cache = torch.randn(2, B, G, T, D, generator=g).to(dtype)
    pos = torch.tensor([0, T - 1, T // 2][:B])
    rows = torch.arange(B)
    out = decode_attention(
        qkv[:, :, :r], cache[0], cache[1], pos, D**-0.5, splits=splits,
        new_kv=(qkv[:, :, r], qkv[:, :, r + 1]), rope=(cos, sin_signed),
    )  # fmt: skip
    # the rotated key, stored (bf16: one rounding step apart where the kernel's fused multiply-add rounds otherwise)
    one_step = 2**-7 if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(cache[0, rows, :, pos], k_rot, rtol=one_step, atol=1e-5)
    assert torch.equal(cache[1, rows, :, pos], qkv[:, :, r + 1])  # the value as it came
    ref = _reference(q_rot, cache[0], cache[1], pos, D**-0.5)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=atol)
    with pytest.raises(ValueError, match="rope needs new_kv"):
        decode_attention(qkv[:, :, :r], cache[0], cache[1], pos, 1.0, rope=(cos, sin_signed))


def test_non_contiguous_head_dimension_is_refused():
    q = torch.randn(1, 1, 2, 16)
    kv = torch.randn(2, 1, 1, 16, 8).transpose(-1, -2)  # [.., T=8, D=16] with stride 8 along D
    with pytest.raises(ValueError, match="keys needs a contiguous last dimension"):
        decode_attention(q, kv[0], kv[1], torch.tensor([3]), 0.25)


def test_availability_probe(monkeypatch):
    """`unavailable` answers None where the kernel runs (here: the interpreter, after a tiny call checked against
    plain attention, bf16 and fp32, head widths 128 and 24) and names the reason where it does not."""
    from aligner.generation.native.triton_decode import unavailable

    cpu = torch.device("cpu")
    assert unavailable(cpu, torch.bfloat16, 128) is None and unavailable(cpu, torch.float32, 24) is None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "needs a CUDA device" in unavailable(cpu)
