"""A decode step's token choice and its bookkeeping in two Triton kernels (greedy and plain sampling).

sampling.choose_and_record, compiled by torch.compile, is eleven kernels at 64 rows of a 32,000-token vocabulary:
a reduction over [B, V] for the argmax, a split reduction for the log-sum-exp, and one small kernel for each piece of
the step's state: 22 us a step greedy, 34 sampled, alone on the H200, against 6 and 12 for these two kernels
(docs/PERF.md, "Twenty-second session"; within a decode step the difference shrinks to 0-20 us: the compiled
kernels' launches overlap the kernels before them).
Here:
- `choice_parts`, one program per (row, BLOCK-wide vocabulary chunk): the chunk's winner of the race (its largest
  logits / T, plus the Gumbel noise of sampling.gumbel_noise when sampling; end tokens banned before min_new_t) with
  its first index, and the chunk's log-sum-exp of logits / T as (max, sum of exponentials);
- `choice_merge`, one program for all rows: the row's winner (the first chunk holding the largest value: torch's
  argmax, the first index of the maximum), its log-prob against the merged log-sum-exp, and the step written into
  the engine's state as choose_and_record writes it.
The values are those of the compiled function the engine runs otherwise: logits / T by Triton's float32 division
(as inductor writes it; IEEE's under the interpreter), the argmax's ties to the first index; the noise from the
same hash with log1p computed from log (Goldberg's form: a unit or two off torch's log1p, which moves a draw only
where two tokens' race values lie that close); the log-sum-exp summed in another order (float32 rounding). Top-k
and top-p keep the compiled function.
Runs on CUDA with Triton; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1, as the tests run it).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from aligner.generation.native import pdl, sampling
from aligner.parallel.device import triton_kernels_unavailable

# vocabulary entries per program of choice_parts (one load each: 4 chunks per row at 32,000 tokens) and its warps,
# greedy / sampling: the fastest of 2048-8192 entries and 4 or 8 warps at 64-256 rows on the H200 (docs/PERF.md,
# "Twenty-second session"; benchmarks/probes/token_choice.py)
BLOCK = 8192
NUM_WARPS = {True: 4, False: 8}
MERGE_ROWS = 128  # rows per inner step of the merge program


@lru_cache(maxsize=1)
def _helpers():
    """The noise's helpers, made module globals: a jit function calls another through its module's globals."""
    import triton
    import triton.language as tl

    @triton.jit
    def mix32(h):
        """sampling._mix32 on uint32 values (products wrap modulo 2**32 as its masked ones do)."""
        h = h ^ (h >> 16)
        h = h * tl.full((), 0x85EBCA6B, tl.uint32)
        h = h ^ (h >> 13)
        h = h * tl.full((), 0xC2B2AE35, tl.uint32)
        return h ^ (h >> 16)

    @triton.jit
    def gumbel(row_hash, cols):
        """sampling.gumbel_noise for the tokens `cols` of a row whose stream is `row_hash`."""
        token = (cols + 1).to(tl.uint32) * tl.full((), 0x27D4EB2F, tl.uint32)
        h = _mix32(row_hash ^ token)
        w = tl.minimum((h.to(tl.float32) + 0.5) * 2.3283064365386963e-10, 1.0 - 5.960464477539063e-08)
        y = -w  # log1p(y) = log(u) * y / (u - 1) with u = 1 + y rounded (exact where u == 1: y itself)
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        return -tl.log(-log1p)

    global _mix32, _gumbel
    _mix32, _gumbel = mix32, gumbel


@lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    _helpers()

    @triton.jit
    def choice_parts(
        logits_ptr, s_lb, V, temp_ptr, key_ptr, step_ptr, min_new_ptr, end_ptr, best_ptr, arg_ptr, m_ptr, l_ptr, S,
        BLOCK: tl.constexpr, GREEDY: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        c = tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        if PDL:  # launched early (pdl.py): wait for the kernel that wrote the logits
            tl.extra.cuda.gdc_wait()
        step = tl.load(step_ptr)
        s = tl.load(logits_ptr + b * s_lb + cols, mask=ok, other=float("-inf")).to(tl.float32) / tl.load(temp_ptr)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        race = s
        if step < tl.load(min_new_ptr):  # end tokens banned
            race = tl.where(tl.load(end_ptr + cols, mask=ok, other=0) != 0, float("-inf"), s)
        if not GREEDY:  # this sample's stream at this step, as sampling.gumbel_noise derives it, and its noise
            k = (step + 1).to(tl.uint32) * tl.full((), 0x9E3779B9, tl.uint32)
            race = race + _gumbel(_mix32(tl.load(key_ptr + b).to(tl.uint32) ^ k), cols)
        m = tl.max(s, axis=0)
        at = b * S + c
        tl.store(best_ptr + at, tl.max(race, axis=0))
        tl.store(arg_ptr + at, c * BLOCK + tl.argmax(race, axis=0, tie_break_left=True))
        tl.store(m_ptr + at, m)
        tl.store(l_ptr + at, tl.sum(tl.exp(s - m), axis=0))

    @triton.jit
    def choice_merge(
        best_ptr, arg_ptr, m_ptr, l_ptr, S, B, logits_ptr, s_lb, temp_ptr, step_ptr, end_ptr, ended_ptr, pad_ptr,
        tok_out_ptr, s_tb, logp_out_ptr, s_pb, lengths_ptr, cur_ptr, pos_ptr,
        BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            tl.extra.cuda.gdc_wait()
        temp = tl.load(temp_ptr)
        step = tl.load(step_ptr)
        pad = tl.load(pad_ptr)
        chunks = tl.arange(0, BLOCK_S)
        for r0 in range(0, B, BLOCK_B):
            rows = r0 + tl.arange(0, BLOCK_B)
            rok = rows < B
            at = rows[:, None] * S + chunks[None, :]
            ok = rok[:, None] & (chunks[None, :] < S)
            best = tl.load(best_ptr + at, mask=ok, other=float("-inf"))
            top = tl.max(best, axis=1)
            first = tl.min(tl.where(ok & (best == top[:, None]), chunks[None, :], BLOCK_S), axis=1)
            tok = tl.sum(tl.where(chunks[None, :] == first[:, None], tl.load(arg_ptr + at, mask=ok, other=0), 0), 1)
            m = tl.load(m_ptr + at, mask=ok, other=float("-inf"))
            mx = tl.max(m, axis=1)
            total = tl.sum(tl.load(l_ptr + at, mask=ok, other=0.0) * tl.exp(m - mx[:, None]), axis=1)
            picked = tl.load(logits_ptr + rows * s_lb + tok, mask=rok, other=0.0).to(tl.float32) / temp
            logp = picked - (mx + tl.log(total))
            ended = tl.load(ended_ptr + rows, mask=rok, other=1) != 0
            active = ~ended
            ends_now = active & (tl.load(end_ptr + tok, mask=rok, other=0) != 0)
            tok = tl.where(active, tok.to(tl.int64), pad)
            logp = tl.where(active, logp, 0.0)
            tl.store(tok_out_ptr + rows * s_tb + step, tok, mask=rok)
            tl.store(logp_out_ptr + rows * s_pb + step, logp, mask=rok)
            tl.store(lengths_ptr + rows, tl.load(lengths_ptr + rows, mask=rok) + active.to(tl.int64), mask=rok)
            tl.store(ended_ptr + rows, (ended | ends_now).to(tl.int8), mask=rok)
            tl.store(cur_ptr + rows, tok, mask=rok)
            tl.store(pos_ptr + rows, tl.load(pos_ptr + rows, mask=rok) + 1, mask=rok)
        tl.store(step_ptr, step + 1)

    return choice_parts, choice_merge


def choose_and_record(
    logits_BV: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
    u_BR: torch.Tensor,
    key_B: torch.Tensor,
    step_t: torch.Tensor,
    min_new_t: torch.Tensor,
    top_p: torch.Tensor,
    end_mask_V: torch.Tensor,
    ended_B: torch.Tensor,
    pad_t: torch.Tensor,
    out_tokens_BR: torch.Tensor,
    out_logp_BR: torch.Tensor,
    lengths_B: torch.Tensor,
    cur_tok_B: torch.Tensor,
    pos_B: torch.Tensor,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
) -> None:
    """sampling.choose_and_record (the same arguments and state updates) for greedy choice and plain sampling;
    top-k and top-p are refused (the engine keeps the compiled function for them). The state tensors need contiguous
    rows: the engine's buffers and their first B rows."""
    if top_k or use_top_p:
        raise ValueError("choice.choose_and_record: greedy or plain sampling only (top-k / top-p: sampling.py)")
    B = logits_BV.shape[0]
    for name, t in (("logits_BV", logits_BV), ("out_tokens_BR", out_tokens_BR), ("out_logp_BR", out_logp_BR)):
        if t.stride(-1) != 1:
            raise ValueError(f"choice.choose_and_record: {name} needs a contiguous last dimension")
    S = -(-vocab_size // BLOCK)
    best, m, total = torch.empty((3, B, S), dtype=torch.float32, device=logits_BV.device)  # each chunk's partials
    arg = torch.empty((B, S), dtype=torch.int32, device=logits_BV.device)
    use_pdl = pdl.wanted(logits_BV.device, B)
    launch = {"launch_pdl": True} if use_pdl else {}
    end_V, ended = end_mask_V.view(torch.uint8), ended_B.view(torch.uint8)
    parts, merge = _kernels()
    parts[(B, S)](
        logits_BV, logits_BV.stride(0), vocab_size, temperature, key_B, step_t, min_new_t, end_V, best, arg, m,
        total, S, BLOCK=BLOCK, GREEDY=greedy, PDL=use_pdl, num_warps=NUM_WARPS[greedy], **launch,
    )  # fmt: skip
    merge[(1,)](
        best, arg, m, total, S, B, logits_BV, logits_BV.stride(0), temperature, step_t, end_V, ended, pad_t,
        out_tokens_BR, out_tokens_BR.stride(0), out_logp_BR, out_logp_BR.stride(0), lengths_B, cur_tok_B, pos_B,
        BLOCK_B=min(MERGE_ROWS, 1 << (B - 1).bit_length()), BLOCK_S=max(2, 1 << (S - 1).bit_length()), PDL=use_pdl,
        num_warps=4, **launch,
    )  # fmt: skip


def random_step_state(
    B: int, V: int, V_pad: int, steps: int, device: torch.device, seed: int = 0, temperature: float = 1.0, step: int = 0
) -> dict:
    """The keyword arguments of choose_and_record (either one's, modes aside) for a step of B rows: random bf16
    logits [B, V_pad] of spread 3 over a V-token vocabulary, the samples' keys from seeds 0..B-1, nothing banned or
    ended, fresh output buffers of `steps` columns (the start-up check's and benchmarks/probes/token_choice.py's)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def zeros(*shape, dtype=torch.long):
        return torch.zeros(shape, dtype=dtype, device=device)

    return dict(
        logits_BV=(3 * torch.randn(B, V_pad, generator=g, device=device)).bfloat16(),
        vocab_size=V,
        temperature=torch.full((), temperature, device=device),
        u_BR=zeros(B, steps, dtype=torch.float32),
        key_B=sampling.keys_for_seeds(range(B)).to(device),
        step_t=torch.full((1,), step, dtype=torch.long, device=device),
        min_new_t=zeros(1),
        top_p=torch.ones((), device=device),
        end_mask_V=zeros(V, dtype=torch.bool),
        ended_B=zeros(B, dtype=torch.bool),
        pad_t=zeros(),
        out_tokens_BR=zeros(B, steps),
        out_logp_BR=zeros(B, steps, dtype=torch.float32),
        lengths_B=zeros(B),
        cur_tok_B=zeros(B),
        pos_B=zeros(B),
    )


def unavailable(device: torch.device) -> str | None:
    """Why the kernels cannot run here (None if they can): Triton on a CUDA device of compute capability 8.0 or newer
    (or Triton's interpreter), and a tiny step of each mode that must record what sampling.choose_and_record
    records (the same tokens, log-probs to float32 rounding)."""
    why_not = triton_kernels_unavailable(device)
    if why_not is not None:
        return why_not
    try:
        for greedy in (True, False):
            want = random_step_state(4, 3000, 3008, 3, device, temperature=0.7, step=1)
            got = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in want.items()}
            sampling.choose_and_record(**want, greedy=greedy, top_k=0, use_top_p=False)
            choose_and_record(**got, greedy=greedy, top_k=0, use_top_p=False)
            same = all(
                torch.equal(got[k], want[k])
                for k in ("out_tokens_BR", "step_t", "pos_B", "cur_tok_B", "lengths_B", "ended_B")
            )
            if not same or not torch.allclose(got["out_logp_BR"], want["out_logp_BR"], rtol=0, atol=1e-4):
                return f"the kernels' {'greedy' if greedy else 'sampled'} step differs from torch's here"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here; the message says which
        return f"the kernels failed here ({type(exc).__name__}: {exc})"
    return None
