"""The Triton decode attention kernel (aligner.generation.native.triton_decode) under Triton's interpreter on the CPU
(tests/conftest.py turns it on): against plain attention over each sample's first pos_b + 1 slots, for GQA group
sizes 1-3, power-of-two and other head widths, one and several slot ranges (the split path and its merge), float32
and bfloat16. The engine's greedy decoding with it is checked in test_generation_engine.py; its speed on a GPU in
docs/PERF.md."""

import pytest
import torch

pytest.importorskip("triton")

from aligner.generation.native import triton_decode as td  # noqa: E402
from aligner.generation.native.triton_decode import decode_attention  # noqa: E402


def _reference(q, keys, values, pos, scale):
    T = keys.shape[2]
    scores = torch.einsum("bgrd,bgtd->bgrt", q.float(), keys.float()) * scale
    beyond = torch.arange(T)[None, None, None, :] > pos[:, None, None, None]
    probs = scores.masked_fill(beyond, float("-inf")).softmax(-1)
    return torch.einsum("bgrt,bgtd->bgrd", probs, values.float())


def _attended_with_reference(q, kv, pos, new, fp8: bool, **kwargs):
    """decode_attention over the float32 cache kv [2, B, G, T, D] (fp8: quantized, values in chunks of 16 slots) with
    the step's own key and value `new` written by the kernel, and plain attention over the cache as the kernel left
    it (dequantized)."""
    from aligner.generation.native.triton_decode import quantize_fp8, value_rows, write_value_chunks

    B, G, T, D = kv.shape[1:]
    extra, values = {}, kv[1]
    if fp8:
        kv8, scales = quantize_fp8(kv)
        values = torch.zeros(B, G, T // 16, D, 16).to(kv8.dtype)
        write_value_chunks(values, kv8[1])
        extra["kv_scales"] = (scales[0], scales[1])
        kv = kv8
    out = decode_attention(q, kv[0], values, pos, D**-0.5, new_kv=new, **extra, **kwargs)
    if fp8:
        kv = torch.stack([kv8[0], value_rows(values)]).float() * scales[..., None]
    else:
        rows = torch.arange(B)
        kv[0, rows, :, pos], kv[1, rows, :, pos] = new
    return out, _reference(q, kv[0], kv[1], pos, D**-0.5)


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


def test_wider_slot_steps_from_wide_min_batch_rows(monkeypatch):
    """The slots per inner step by default: BLOCK_N below WIDE_MIN_BATCH rows, WIDE_BLOCK_N from there on (here from
    3 rows); both agree with plain attention, and the default's result is the chosen width's, bit for bit."""
    from aligner.generation.native import triton_decode

    monkeypatch.setattr(triton_decode, "WIDE_MIN_BATCH", 3)
    g = torch.Generator().manual_seed(7)
    B, G, r, D, T = 3, 2, 2, 16, 150
    q = torch.randn(B, G, r, D, generator=g)
    keys, values = torch.randn(2, B, G, T, D, generator=g)
    pos = torch.tensor([T - 1, 100, 70])
    for rows, width in ((2, triton_decode.BLOCK_N), (3, triton_decode.WIDE_BLOCK_N)):
        args = (q[:rows], keys[:rows], values[:rows], pos[:rows], D**-0.5)
        out = decode_attention(*args)
        assert torch.equal(out, decode_attention(*args, block=width))
        other = triton_decode.WIDE_BLOCK_N + triton_decode.BLOCK_N - width
        assert not torch.equal(out, decode_attention(*args, block=other))  # the widths' sums differ in their order
        torch.testing.assert_close(out, _reference(*args), rtol=0, atol=1e-5)


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


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2.5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,G,r,D,T,splits", [(3, 2, 2, 64, 50, 1), (3, 3, 1, 24, 33, 3)])
def test_qk_norms_applied_before_rope_by_the_kernel(dtype, atol, B, G, r, D, T, splits):
    """qk_norm: each query head and the new key RMS-normed with their own weights (Qwen3's q_layernorm /
    k_layernorm), then rotated, as torch's rms_norm and megatron's RoPE compute them; the normed, rotated key
    written. The kernel's own norm replaces the engine's norm-and-RoPE kernel between qkv and the attention."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(B * 5 + D)
    qkv = (3.0 * torch.randn(B, G, r + 2, D, generator=g)).to(dtype)
    q_w, k_w = (1.0 + 0.3 * torch.randn(2, D, generator=g)).to(dtype)
    eps = 1e-6
    angles = torch.rand(B, D // 2, generator=g) * 6.0
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin_signed = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)

    def norm_rotate(t, w):  # [B, G, n, D]: torch's rms_norm in t's dtype, then megatron's RoPE in float32
        t = F.rms_norm(t, (D,), w, eps).float()
        t1, t2 = t.chunk(2, -1)
        sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype).float()
        return (t * cos.float()[:, None, None] + torch.cat((-t2, t1), -1) * sin[:, None, None]).to(dtype)

    q_ref, k_ref = norm_rotate(qkv[:, :, :r], q_w), norm_rotate(qkv[:, :, r : r + 1], k_w)[:, :, 0]
    cache = torch.randn(2, B, G, T, D, generator=g).to(dtype)
    pos = torch.tensor([0, T - 1, T // 2][:B])
    rows = torch.arange(B)
    out = decode_attention(
        qkv[:, :, :r], cache[0], cache[1], pos, D**-0.5, splits=splits,
        new_kv=(qkv[:, :, r], qkv[:, :, r + 1]), rope=(cos, sin_signed), qk_norm=(q_w, k_w, eps),
    )  # fmt: skip
    # bf16: two roundings (the norm's, the rotation's) that Triton's interpreter does not take to nearest every time
    # (rows.py's EMULATE): up to two steps of the largest values (~4) apart
    two_steps = 2 * 2**-7 * 4 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(cache[0, rows, :, pos], k_ref, rtol=0, atol=two_steps)
    assert torch.equal(cache[1, rows, :, pos], qkv[:, :, r + 1])  # the value as it came: not normed
    torch.testing.assert_close(out.float(), _reference(q_ref, cache[0], cache[1], pos, D**-0.5), rtol=0, atol=atol)
    with pytest.raises(ValueError, match="qk_norm needs rope"):
        decode_attention(qkv[:, :, :r], cache[0], cache[1], pos, 1.0, new_kv=(qkv[:, :, r], qkv[:, :, r + 1]),
                         qk_norm=(q_w, k_w, eps))  # fmt: skip
    with pytest.raises(ValueError, match="qk_norm's weights need shape"):
        decode_attention(qkv[:, :, :r], cache[0], cache[1], pos, 1.0, new_kv=(qkv[:, :, r], qkv[:, :, r + 1]),
                         rope=(cos, sin_signed), qk_norm=(q_w.double(), k_w, eps))  # fmt: skip


def test_quantize_fp8_by_hand():
    """Each row over its own scale amax / 448: the largest entry becomes 448, the others round to e4m3's grid (3
    mantissa bits); a row of zeros keeps scale 1."""
    from aligner.generation.native.triton_decode import quantize_fp8

    x = torch.tensor([[0.0, 1.0, -2.0, 4.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.3, 0.0, -0.5]])
    x8, scale = quantize_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([4 / 448, 1.0, 1 / 448]), rtol=0, atol=0)
    # row 0: 0, 112, -224, 448 (all on the grid); row 2: 0.3 * 448 = 134.4 -> 128 (grid step 16 in [128, 256))
    assert x8.float().tolist() == [[0.0, 112.0, -224.0, 448.0], [0.0] * 4, [448.0, 128.0, 0.0, -224.0]]


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("chunk", [0, 16], ids=["rows", "chunks"])
def test_fp8_cache_read_and_written_by_the_kernel(act, splits, rope, chunk):
    """An FP8 cache (generation.kv_dtype=fp8): the kernel reads e4m3 keys and values with their per-slot scales, and
    writes the step's own key (rotated) and value quantized by quantize_fp8's rule, bit for bit (the rounding at
    powers of two included: values that round up into the next binade); it attends to them as later steps will read
    them. Against plain attention over the dequantized cache. Values as rows [T, D] or in chunks of 16 slots
    [T / 16, D, 16] (the engine's layout, with its V_CHUNK), where the kernel also reads the slots past each
    sample's position in its last chunk (probability 0) and the step's value is written into a chunk."""
    from aligner.generation.native.triton_decode import quantize_fp8, value_rows, write_value_chunks

    B, G, r, D, T = 3, 2, 2, 64, 48 if chunk else 50
    g = torch.Generator().manual_seed(11 + splits)
    qkv = torch.randn(B, G, r + 2, D, generator=g).to(act)
    cache, scales = quantize_fp8(torch.randn(2, B, G, T, D, generator=g))
    pos = torch.tensor([0, T - 1, T // 2])
    rows = torch.arange(B)
    q, k_new, v_new = qkv[:, :, :r], qkv[:, :, r], qkv[:, :, r + 1]
    extra = {}
    if rope:
        angles = torch.rand(B, D // 2, generator=g) * 6.0
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(act)
        sin_signed = torch.cat((-angles.sin(), angles.sin()), -1).to(act)
        extra["rope"] = (cos, sin_signed)

        sin = torch.cat((angles.sin(), angles.sin()), -1).to(act).float()

        def rotate(t):  # [B, G, n, D] as megatron: t * cos + [-t2, t1] * sin, rounded to the activations' dtype
            t1, t2 = t.float().chunk(2, -1)
            return (t.float() * cos.float()[:, None, None] + torch.cat((-t2, t1), -1) * sin[:, None, None]).to(act)

    values = cache[1]
    if chunk:
        values = torch.full((B, G, T // chunk, D, chunk), float("nan")).to(cache.dtype)
        write_value_chunks(values, cache[1])
        assert torch.equal(value_rows(values).view(torch.uint8), cache[1].view(torch.uint8))
    out = decode_attention(
        q, cache[0], values, pos, D**-0.5, splits=splits, new_kv=(k_new, v_new), kv_scales=(scales[0], scales[1]),
        **extra,
    )  # fmt: skip
    assert out.dtype == act
    if chunk:  # the rows the kernel's writes left, for the checks below
        cache = torch.stack([cache[0], value_rows(values)])
    written = torch.stack([cache[0, rows, :, pos], cache[1, rows, :, pos]])  # [2, B, G, D]
    written_scales = torch.stack([scales[0, rows, :, pos], scales[1, rows, :, pos]])
    if not rope:
        expected8, expected_scales = quantize_fp8(torch.stack([k_new, v_new]))
        assert torch.equal(written.float(), expected8.float()) and torch.equal(written_scales, expected_scales)
    else:  # the value as it came; the key rotated (one bf16 rounding apart where a fused multiply-add rounds otherwise)
        v8, v_s = quantize_fp8(v_new)
        assert torch.equal(written[1].float(), v8.float()) and torch.equal(written_scales[1], v_s)
    dequantized = cache.float() * scales[..., None]
    if rope:
        q = rotate(q)
    ref = _reference(q, dequantized[0], dequantized[1], pos, D**-0.5)
    bf16 = act == torch.bfloat16  # q and the output rounded to bf16
    torch.testing.assert_close(out.float(), ref, rtol=2**-7 if bf16 else 0, atol=1.6e-2 if bf16 else 1e-5)
    with pytest.raises(ValueError, match="kv_scales go with an FP8 cache"):
        decode_attention(q, cache[0], cache[1], pos, 1.0)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32_cache", "fp8_cache"])
def test_softmax_in_base_2_gives_the_same_attention(splits, fp8):
    """exp2=True (triton_decode.EXP2: scale times log2(e), exp2 for every exponential, the split merge's included)
    attends as the natural-base softmax does: both within float32 rounding of plain attention, with the step's own
    key and value written (their score's exponential too) and, for an FP8 cache, values in chunks."""
    B, G, r, D, T = 3, 2, 2, 32, 48
    g = torch.Generator().manual_seed(5 + splits)
    qkv = torch.randn(B, G, r + 2, D, generator=g)
    q, new = qkv[:, :, :r], (qkv[:, :, r], qkv[:, :, r + 1])
    pos = torch.tensor([0, T - 1, T // 2])
    outs = {}
    for exp2 in (False, True):
        kv = torch.randn(2, B, G, T, D, generator=torch.Generator().manual_seed(1))
        outs[exp2], ref = _attended_with_reference(q, kv, pos, new, fp8, splits=splits, exp2=exp2)
        torch.testing.assert_close(outs[exp2], ref, rtol=0, atol=1e-5)
    assert not torch.equal(outs[True], outs[False])  # the base-2 path did run


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32_cache", "fp8_cache"])
@pytest.mark.parametrize("r, r_pad", [(1, 8), (2, 2), (2, 8), (3, 4), (3, 2)])
def test_query_rows_padded_to_fewer_than_16(splits, fp8, r, r_pad):
    """r_pad (triton_decode.FP8_R_PAD: a program's r query rows padded to fewer than a tensor-core product's 16; a
    power of two, at least r's) attends as plain attention: rows of padding (r_pad 8 for 1 or 2 heads, 4 for 3), none
    (2 for 2), r_pad below r (3 heads: padded to 4), the step's own key and value written, split ranges, an FP8 cache
    with values in chunks. A padding that is no power of two is refused."""
    B, G, D, T = 3, 2, 32, 48
    g = torch.Generator().manual_seed(11 + 10 * r + splits)
    qkv = torch.randn(B, G, r + 2, D, generator=g)
    q, new = qkv[:, :, :r], (qkv[:, :, r], qkv[:, :, r + 1])
    pos = torch.tensor([0, T - 1, T // 2])
    kv = torch.randn(2, B, G, T, D, generator=g)
    with pytest.raises(ValueError, match="r_pad must be a power of two"):
        decode_attention(q, kv[0], kv[1], pos, 1.0, r_pad=6)
    out, ref = _attended_with_reference(q, kv, pos, new, fp8, splits=splits, r_pad=r_pad)
    assert out.shape == (B, G, r, D) and not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("cache", ["fp32", "fp8"])
@pytest.mark.parametrize("exp2", [False, True], ids=["exp", "exp2"])
def test_warp_slots_give_the_same_attention(splits, cache, exp2):
    """warp_slots=True (triton_decode.FP8_WARP_SLOTS: each warp its own block / num_warps slots of a step, its own
    running max, sum and output, merged after the loop) attends as the shared form does, within float32 rounding:
    positions where some warps' slots all lie past the last one (pos 3: three of four warps hold none in the only
    step; pos 0 with the step's own key: no step at all), the split ranges and their merge, the step's own key and
    value with RoPE, an FP8 cache with values in chunks, either base of the softmax."""
    from aligner.generation.native.triton_decode import quantize_fp8, write_value_chunks

    B, G, r, D, T = 4, 2, 2, 32, 192
    g = torch.Generator().manual_seed(3 + splits)
    qkv = torch.randn(B, G, r + 2, D, generator=g)
    q, new = qkv[:, :, :r], (qkv[:, :, r], qkv[:, :, r + 1])
    angles = torch.rand(B, D // 2, generator=g) * 6.0
    rope = (torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1))
    pos = torch.tensor([0, 3, T - 1, 100])
    outs = {}
    for warp_slots in (False, True):
        kv = torch.randn(2, B, G, T, D, generator=torch.Generator().manual_seed(1))
        extra, values = {}, kv[1]
        if cache == "fp8":
            kv, scales = quantize_fp8(kv)
            values = torch.zeros(B, G, T // 64, D, 64).to(kv.dtype)
            write_value_chunks(values, kv[1])
            extra["kv_scales"] = (scales[0], scales[1])
        outs[warp_slots] = decode_attention(
            q, kv[0], values, pos, D**-0.5, splits=splits, block=64, num_warps=4, new_kv=new, rope=rope, exp2=exp2,
            warp_slots=warp_slots, **extra,
        )  # fmt: skip
    assert not outs[True].isnan().any()
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=1e-5)
    assert not torch.equal(outs[True], outs[False])  # summed in another order: the warp-slots form did run
    with pytest.raises(ValueError, match="warp_slots needs the 32 slots of a step in 4 warps' shares of 16"):
        decode_attention(q, kv[0], values, pos, 1.0, block=32, num_warps=4, warp_slots=True, **extra)


def _cache_as(cache: str, kv):
    """(keys, values, extra arguments) of a [2, B, G, T, D] float32 cache as decode_attention takes it: fresh copies,
    for "fp8" quantized (values in chunks of 64 slots) with its scales."""
    from aligner.generation.native.triton_decode import quantize_fp8, write_value_chunks

    if cache != "fp8":
        return kv[0].clone(), kv[1].clone(), {}
    B, G, T, D = kv.shape[1:]
    kv8, scales = quantize_fp8(kv)
    values = torch.zeros(B, G, T // 64, D, 64).to(kv8.dtype)
    write_value_chunks(values, kv8[1])
    return kv8[0].clone(), values, {"kv_scales": (scales[0].clone(), scales[1].clone())}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("cache", ["fp32", "fp8"])
@pytest.mark.parametrize("warp_slots", [False, True], ids=["shared_steps", "warp_slots"])
def test_a_groups_prompt_slots_read_from_its_lead_row(splits, cache, warp_slots):
    """shared=(lead_B, shared_B) (triton_decode.SHARED_PREFIX): the steps wholly inside a row's slots [0, shared) read
    the lead row's cache, the rest (the last partial step of the prompt included) its own. Here the rows' own copies
    of the lead's slots are garbage where the lead is to be read: the result is attention over the lead's prompt
    slots and the row's own slots after them (the step's own key and value with RoPE written into its own row), for
    either loop form, split ranges and an FP8 cache with values in chunks."""
    B, G, r, D, T, block = 4, 2, 2, 32, 192, 64
    g = torch.Generator().manual_seed(7 + splits)
    qkv = torch.randn(B, G, r + 2, D, generator=g)
    q, new = qkv[:, :, :r], (qkv[:, :, r], qkv[:, :, r + 1])
    angles = torch.rand(B, D // 2, generator=g) * 6.0
    rope = (torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1))
    pos = torch.tensor([150, 170, 100, 190])
    lead, shared = torch.tensor([0, 0, 0, 3]), torch.tensor([140, 140, 64, 0])  # rows 1-2 read row 0's first steps
    true_kv = torch.randn(2, B, G, T, D, generator=torch.Generator().manual_seed(1))
    true_kv[:, 1:3, :, :140] = true_kv[:, :1, :, :140]  # the group's prompt: 140 slots, the same in rows 0-2
    kv = true_kv.clone()
    kv[:, 1, :, :128] = 50.0  # row 1's copy of the two whole steps it reads from row 0 (128 of its 140 slots)
    kv[:, 2, :, :64] = -50.0  # row 2 shares 64 slots: one step
    outs = {}
    for name, cache_kv, sh in (("shared", kv, (lead, shared)), ("plain", true_kv, None)):
        keys, values, extra = _cache_as(cache, cache_kv)
        args = dict(splits=splits, block=block, num_warps=4, new_kv=new, rope=rope, warp_slots=warp_slots)
        outs[name] = decode_attention(q, keys, values, pos, D**-0.5, shared=sh, **args, **extra)
        if name == "shared":  # the step's own key went into each row's own cache, never the lead's
            written = keys[torch.arange(B), :, pos]
            assert (written != 0).any(-1).all() and not torch.equal(keys[0, :, pos[1]], written[1])
    assert not outs["shared"].isnan().any()
    torch.testing.assert_close(outs["shared"], outs["plain"], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"shared needs two tensors of shape \(4,\)"):
        decode_attention(q, keys, values, pos, 1.0, shared=(lead[:2], shared), **extra)


@pytest.mark.parametrize("cache", ["fp32", "fp8"])
@pytest.mark.parametrize("r", [2, 3])
def test_a_groups_prompt_attended_once_for_a_chunk_of_its_rows(cache, r):
    """groups=(from_B, chunks) (triton_decode.GROUP_PREFIX): a group program attends a chunk of rows' query rows
    together over the lead's whole prompt steps, each row's program its slots after them, merged: the attention of
    each row over the true prompt and its own later slots. Rows: a group of 9 (prompt 140: a chunk of
    group_rows(r) rows, the rest in a chunk of their own or, one row left, by its row program reading the lead as
    `shared` does), a group of 3 with a prompt shorter than a step (a chunk with no whole step), a row alone. The
    rows' own copies of the lead's whole steps are garbage wherever the lead is to be read."""
    from aligner.generation.native.triton_decode import group_chunks, group_rows

    B, G, D, T, block = 13, 2, 32, 256, 64
    per_chunk = group_rows(r)
    g = torch.Generator().manual_seed(11 + r)
    qkv = torch.randn(B, G, r + 2, D, generator=g)
    q, new = qkv[:, :, :r], (qkv[:, :, r], qkv[:, :, r + 1])
    angles = torch.rand(B, D // 2, generator=g) * 6.0
    rope = (torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1))
    lead = torch.tensor([0] * 9 + [9] * 3 + [12])
    lengths = torch.tensor([140] * 9 + [40] * 3 + [70])
    pos = torch.tensor([150, 151, 140, 200, 170, 160, 141, 255, 180, 40, 90, 41, 100])
    from_B, chunks = group_chunks(lead, lengths, per_chunk)
    first_chunk = [0, min(per_chunk, 9), 140]
    second = per_chunk if 9 - per_chunk >= 2 else 9  # the group of 9's second chunk, or the group of 3's
    assert chunks.shape == (6, 3) and chunks[0].tolist() == first_chunk and chunks[1, 0].item() == second
    covered = 9 if 9 % per_chunk != 1 else 8
    assert from_B.tolist() == [140] * covered + [-1] * (9 - covered) + [40] * 3 + [-1]
    true_kv = torch.randn(2, B, G, T, D, generator=torch.Generator().manual_seed(1))
    true_kv[:, 1:9, :, :140] = true_kv[:, :1, :, :140]
    true_kv[:, 10:12, :, :40] = true_kv[:, 9:10, :, :40]
    kv = true_kv.clone()
    kv[:, 1:9, :, :128] = 50.0  # the whole steps read from row 0 (by a group program or, row 8, as `shared`)
    outs = {}
    for name, cache_kv, sh, grp in (
        ("groups", kv, (lead, lengths), (from_B, chunks)), ("plain", true_kv, None, None)
    ):  # fmt: skip
        keys, values, extra = _cache_as(cache, cache_kv)
        args = dict(block=block, num_warps=4, new_kv=new, rope=rope, shared=sh, groups=grp)
        lead_keys = keys[0].clone()
        outs[name] = decode_attention(q, keys, values, pos, D**-0.5, **args, **extra)
        if name == "groups":  # the step's own key went into each row's own cache, the lead's only its own row's
            lead_keys[:, pos[0]] = keys[0, :, pos[0]]
            assert (keys[torch.arange(B), :, pos] != 0).any(-1).all() and torch.equal(keys[0], lead_keys)
    assert not outs["groups"].isnan().any()
    torch.testing.assert_close(outs["groups"], outs["plain"], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="groups need shared"):
        decode_attention(q, keys, values, pos, 1.0, groups=(from_B, chunks), **extra)
    with pytest.raises(ValueError, match="contiguous int32"):
        decode_attention(q, keys, values, pos, 1.0, shared=(lead, lengths), groups=(from_B, chunks.long()), **extra)


def test_group_chunks_cover_each_group_in_chunks_of_two_rows_or_more():
    """group_chunks: chunks of up to `rows` rows from each group's first row, none of one row, each chunk's first row,
    count and prompt length; from_B the prompt's length for a covered row, -1 for another."""
    from aligner.generation.native.triton_decode import group_chunks

    lead = torch.tensor([0, 0, 0, 0, 0, 5, 6, 6, 8, 8, 8])
    lengths = torch.tensor([7] * 5 + [3] + [9] * 2 + [4] * 3)
    from_B, chunks = group_chunks(lead, lengths, 2)
    assert chunks.tolist() == [[0, 2, 7], [2, 2, 7], [6, 2, 9], [8, 2, 4], [0, 0, 0]]
    assert from_B.tolist() == [7, 7, 7, 7, -1, -1, 9, 9, 4, 4, -1]
    from_B, chunks = group_chunks(lead, lengths, 8)
    assert chunks.tolist() == [[0, 5, 7], [6, 2, 9], [8, 3, 4], [0, 0, 0], [0, 0, 0]]
    assert from_B.tolist() == [7] * 5 + [-1] + [9, 9] + [4] * 3


def test_non_contiguous_head_dimension_is_refused():
    q = torch.randn(1, 1, 2, 16)
    kv = torch.randn(2, 1, 1, 16, 8).transpose(-1, -2)  # [.., T=8, D=16] with stride 8 along D
    with pytest.raises(ValueError, match="keys needs a contiguous last dimension"):
        decode_attention(q, kv[0], kv[1], torch.tensor([3]), 0.25)


def test_availability_probe(monkeypatch):
    """`unavailable` answers None where the kernel runs (here: the interpreter, after a tiny call checked against
    plain attention, bf16 and fp32, head widths 128 and 24, with GROUP_PREFIX also a group program's call) and names
    the reason where it does not."""
    from aligner.generation.native.triton_decode import unavailable

    cpu = torch.device("cpu")
    assert unavailable(cpu, torch.bfloat16, 128) is None and unavailable(cpu, torch.float32, 24) is None
    monkeypatch.setattr(td, "GROUP_PREFIX", True)  # with the group programs' form too
    assert unavailable(cpu, td.FP8, 128) is None and unavailable(cpu, torch.float32, 24) is None
    chunks = td.group_chunks  # rows told to attend their prompt too: counted twice
    monkeypatch.setattr(td, "group_chunks", lambda *a: (torch.full_like(a[1], -1), chunks(*a)[1]))
    assert "differs from plain attention" in unavailable(cpu, torch.float32, 24)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "needs a CUDA device" in unavailable(cpu)


def test_value_chunks_written_whole_and_read_back():
    """write_value_chunks puts slot t, dimension d of [B, G, t, D] values at (t // C, d, t % C) of the chunks, fills
    the rest of the last chunk written with zeros and leaves later chunks alone; value_rows reads them back."""
    from aligner.generation.native.triton_decode import FP8, value_rows, write_value_chunks

    B, G, D, C = 2, 3, 4, 8
    values = torch.randn(B, G, 11, D).to(FP8)
    chunks = torch.full((B, G, 3, D, C), 7.0).to(FP8)
    write_value_chunks(chunks, values)
    assert chunks[1, 2, 1, 3, 2].float() == values[1, 2, 10, 3].float()  # slot 10 = chunk 1, position 2
    rows = value_rows(chunks).float()
    assert torch.equal(rows[:, :, :11], values.float())
    assert not rows[:, :, 11:16].any()  # the rest of chunk 1: zeros
    assert (rows[:, :, 16:] == 7.0).all()  # chunk 2: untouched
    with pytest.raises(ValueError, match="chunked values need shape"):
        keys, scales = torch.randn(B, G, 24, D).to(FP8), torch.ones(B, G, 24)
        decode_attention(
            torch.randn(B, G, 1, D), keys, chunks[:, :, :2], torch.tensor([3, 4]), 1.0, kv_scales=(scales, scales)
        )


@pytest.mark.parametrize("D", [64, 24])
def test_prefill_fp8_writes_what_quantize_fp8_gives(D):
    """prefill_fp8 (one kernel: a prompt's keys and values into an FP8 cache, values in chunks) against quantize_fp8
    and write_value_chunks: the same e4m3 values and scales in the same places, the dequantized values returned for
    the prompt's attention, nothing written past the prompt's slots; a NaN in the input leaves only finite values
    in the cache (the decode kernel reads whole chunks of values)."""
    from aligner.generation.native.triton_decode import FP8, prefill_fp8, quantize_fp8, value_rows, write_value_chunks

    B, T, G, S, C = 2, 45, 3, 64, 16
    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(2, B, T, G, D, generator=g) * torch.logspace(-3, 1, T)[None, None, :, None, None]).bfloat16()
    kv[0, 1, 3, 2] = 0.0  # a zero row: scale 1
    keys = torch.full((B, G, S, D), 7.0).to(FP8)
    chunks = torch.full((B, G, S // C, D, C), 7.0).to(FP8)
    scales = torch.full((2, B, G, S), -1.0)
    deq = prefill_fp8(kv, keys, chunks, scales)
    kv8, ref_scales = quantize_fp8(kv.transpose(2, 3))  # [2, B, G, T, D]
    assert torch.equal(keys[:, :, :T].float(), kv8[0].float()) and (keys[:, :, T:].float() == 7.0).all()
    assert torch.equal(value_rows(chunks)[:, :, :T].float(), kv8[1].float())
    assert (value_rows(chunks)[:, :, T:].float() == 7.0).all()
    assert torch.equal(scales[..., :T], ref_scales) and (scales[..., T:] == -1.0).all()
    # (one bf16 step apart at most: Triton's interpreter truncates where the GPU rounds to bfloat16)
    assert deq.dtype == torch.bfloat16
    torch.testing.assert_close(
        deq.float(), (kv8.float() * ref_scales[..., None]).bfloat16().float(), rtol=2**-7, atol=0
    )
    ref_chunks = torch.full_like(chunks, 7.0)
    write_value_chunks(ref_chunks, kv8[1])
    assert torch.equal(chunks[:, :, :2].float(), ref_chunks[:, :, :2].float())  # chunks 0-1: slots 0-31
    kv[1, 0, 5, 1, 2] = float("nan")
    prefill_fp8(kv, keys, chunks, scales)
    assert torch.isfinite(keys.float()).all() and torch.isfinite(chunks.float()).all()


def test_fp8_launch_by_batch_size_and_the_settings_that_override_it(monkeypatch):
    """An FP8 cache's launch on the GPU as timed on an H200 (docs/PERF.md, thirty-first session): 128 slots in 4
    warps below FP8_NARROW_MIN_BATCH rows, 64 in 2 warps from there, a cap of 128 registers and base 2 at both; the
    module's FP8 settings, set, hold at every size (how the probes time a candidate in the engine)."""
    common = dict(num_stages=2, maxnreg=128, exp2=True, warp_slots=False)
    assert td.fp8_launch(64) == dict(block=128, num_warps=4, **common)
    assert td.fp8_launch(td.FP8_NARROW_MIN_BATCH - 1)["num_warps"] == 4
    assert td.fp8_launch(td.FP8_NARROW_MIN_BATCH) == td.fp8_launch(256) == dict(block=64, num_warps=2, **common)
    for name, value in (("FP8_BLOCK_N", 128), ("FP8_WARPS", 4), ("FP8_MAXNREG", 0), ("EXP2", False)):
        monkeypatch.setattr(td, name, value)
    plain = dict(block=128, num_warps=4, num_stages=2, maxnreg=0, exp2=False, warp_slots=False)
    assert td.fp8_launch(64) == td.fp8_launch(512) == plain


def test_one_warp_launch_by_the_calls_form(monkeypatch):
    """FP8_ONE_WARP_MIN_BATCH (off: None): from that many rows, calls without a group's shared prompt take 32 slots a
    step in one warp at FP8_ONE_WARP_MAXNREG; calls with one keep the batch size's launch."""
    assert td.fp8_launch(256) == td.fp8_launch(256, shared=True)
    monkeypatch.setattr(td, "FP8_ONE_WARP_MIN_BATCH", 128)
    monkeypatch.setattr(td, "FP8_ONE_WARP_MAXNREG", 168)
    common = dict(num_stages=2, exp2=True, warp_slots=False)
    assert td.fp8_launch(127) == dict(block=128, num_warps=4, maxnreg=128, **common)
    assert td.fp8_launch(128) == td.fp8_launch(512) == dict(block=32, num_warps=1, maxnreg=168, **common)
    assert td.fp8_launch(256, shared=True) == dict(block=64, num_warps=2, maxnreg=128, **common)
    monkeypatch.setattr(td, "FP8_MAXNREG", 0)  # the module's settings still hold at every size and form
    assert td.fp8_launch(256)["maxnreg"] == td.fp8_launch(256, shared=True)["maxnreg"] == 0


def _run_ptx(asm: str, registers: dict) -> dict:
    """The instructions of `asm` (mov, prmt, and, shr, lop3 on .b32; PTX's rules) on 32-bit integer registers."""
    import re

    def value(token):
        return registers[token] if token in registers else int(token, 0)

    for line in asm.splitlines():
        m = re.match(r"\s*(mov|prmt|and|shr|lop3)\.b32 (.+);", line)
        if not m:
            continue
        op, (d, *src) = m.group(1), [t.strip() for t in m.group(2).split(",")]
        a = [value(t) for t in src]
        if op == "mov":
            out = a[0]
        elif op == "and":
            out = a[0] & a[1]
        elif op == "shr":
            out = a[0] >> a[1]
        elif op == "prmt":  # result byte i: byte (c >> 4i) & 7 of {b, a} (a's bytes 0-3, b's 4-7)
            both = a[0] | a[1] << 32
            out = sum(((both >> 8 * ((a[2] >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        else:  # lop3: each bit of the result is the look-up table's bit at (a, b, c)'s bits
            out = sum(((a[3] >> ((a[0] >> i & 1) << 2 | (a[1] >> i & 1) << 1 | (a[2] >> i & 1))) & 1) << i
                      for i in range(32))  # fmt: skip
        registers[d] = out & 0xFFFFFFFF
    return registers


def test_e4m3_by_bit_operations_is_exact():
    """triton_decode.E4M3_BITS_ASM (FP8_BITS_CVT), run by PTX's rules: four e4m3 bytes in, the float16 halves of
    their values times 2^-8 out, in order, for every finite e4m3 value (subnormals and both zeros included)."""
    finite = [b for b in range(256) if b & 0x7F != 0x7F]  # 0x7F / 0xFF: e4m3's NaNs
    wanted = torch.tensor(finite, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16) / 256
    got = []
    for i in range(0, len(finite), 4):
        quad = (finite[i : i + 4] + [0, 0, 0])[:4]
        regs = _run_ptx(td.E4M3_BITS_ASM, {"$2": quad[0] | quad[1] << 8 | quad[2] << 16 | quad[3] << 24})
        halves = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        got += halves[: len(finite[i : i + 4])]
    got = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(torch.float16)
    assert torch.equal(got.view(torch.int16), wanted.view(torch.int16))
