"""The native generation engine: built once, refitted in place, prefill then a (CUDA-graphed) decode loop.

Contract (see aligner.generation.interfaces): `NativeEngine(gen_cfg, model_cfg, policy)` after megatron's parallel
state is initialised, from this rank's policy (with PP > 1 every rank of a pipeline group holds all layers of its TP
shard and generates on its own: see weights.py). Everything is allocated here, once: the engine's view of the
weights (the policy's own tensors where dtype and layout match, else a bf16 copy on GPU), the KV cache for
max_batch_size x (max_prompt_length + max_response_length) tokens, and the static state the decode step reads and
writes (current token and position per sample, step counter, uniforms, ended flags, output buffers). `refit` copies
weights into place (with shared weights: checks they have not moved); `release_memory`/`acquire_memory` free and
re-take the KV cache (graphs are kept when the cache comes back at the same address, re-captured otherwise).

One `generate` call: validate (two host syncs: the prompt lengths, then the tokens' range and which rows repeat the
prompt above them), prefill the distinct prompts in row chunks (a repeated prompt's rows copy its cache slots) and
draw token 0, then decode steps 1..max_new-1. A decode step = forward of one token per sample + gather of the
last logits over TP + sampling + bookkeeping, all on device with static shapes; on GPU with `cuda_graphs` it is
one CUDA graph replay. Graphs are keyed by (batch size, attention length bucket, sampling mode, whether rows repeat
prompts: the Triton attention then reads a group's prompt from its first row) and captured on
first use (the first call pays for capture; later calls replay); the Triton decode attention reads each sample's
own length, so it has a single bucket. The host checks "every sample ended" every
`check_done_every` steps (one sync each) and stops early. Ended samples keep stepping with the pad token (static
shapes) and their outputs are masked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from aligner.config.generation import GenerationConfig
from aligner.families import family
from aligner.generation.interfaces import GenerationOutput, SamplingParams
from aligner.generation.native import choice, fp8, pdl, rows, splitk, triton_decode
from aligner.generation.native.decoder import Decoder, Layout, flash_decode_unavailable
from aligner.generation.native.sampling import choose_and_record, keys_for_seeds, uniforms_for_seeds
from aligner.generation.native.weights import EngineWeights, unwrap_policy
from aligner.models.dtypes import torch_dtype
from aligner.models.rope import passed_channel_scale
from aligner.parallel.device import triton_available

PREFILL_WIDTH_STEP = 64  # a prefill graph's prompt width: the chunk's, rounded up to a multiple of this
log = logging.getLogger(__name__)


def _parallel_state():
    """(TP group, TP size, TP rank, PP group or None, model-parallel group or None)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None, 1, 0, None, None
    pp = ps.get_pipeline_model_parallel_world_size()
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_group() if pp > 1 else None,
        ps.get_model_parallel_group() if pp > 1 else None,
    )


class NativeEngine:
    def __init__(self, gen_cfg: GenerationConfig, model_cfg, policy):
        module = unwrap_policy(policy)
        group, tp, tp_rank, pp_group, mp_group = _parallel_state()
        if pp_group is None and not (module.pre_process and module.post_process):
            raise ValueError("this policy is one pipeline stage but megatron's parallel state says PP=1")
        config = module.config
        if getattr(config, "rotary_interleaved", False):
            raise NotImplementedError("the native engine implements megatron's default RoPE only (non-interleaved)")
        self.cfg, self.model_cfg = gen_cfg, model_cfg
        param = next(module.parameters())
        self.device = param.device
        self.on_gpu = self.device.type == "cuda"
        if gen_cfg.dtype == "auto":
            dtype = torch.bfloat16 if self.on_gpu else param.dtype
        else:
            dtype = torch_dtype(gen_cfg.dtype)
        if gen_cfg.kv_dtype == "fp8":
            kv_dtype = triton_decode.FP8
        else:
            kv_dtype = dtype if gen_cfg.kv_dtype == "auto" else torch_dtype(gen_cfg.kv_dtype)
        self.weights = EngineWeights(module, dtype, self.device, pp_group, share=gen_cfg.share_weights)
        w = self.weights
        log.info(
            "generation engine: %s",
            f"reads the policy's own weights ({w.owned_nbytes() / 2**20:.2f} MiB of other-dtype vectors copied)"
            if w.shared
            else f"holds its own {w.nbytes() / 2**30:.2f} GiB copy of the weights ({w.why_copied})",
        )
        vocab_local = self.weights.get("embedding.word_embeddings.weight").shape[0]
        layout = Layout(
            family=family(model_cfg.arch),
            num_layers=self.weights.num_layers,
            hidden=config.hidden_size,
            heads=config.num_attention_heads // tp,
            groups=(config.num_query_groups or config.num_attention_heads) // tp,
            head_dim=config.kv_channels,
            vocab_size=model_cfg.vocab_size,
            vocab_local=vocab_local,
            tp=tp,
            tp_rank=tp_rank,
            norm_eps=config.layernorm_epsilon,
            qk_norm=bool(config.qk_layernorm),
        )
        self.layout = layout
        self.max_batch = gen_cfg.max_batch_size
        self.max_seq = gen_cfg.max_prompt_length + gen_cfg.max_response_length
        self.max_new = gen_cfg.max_response_length
        attention = gen_cfg.decode_attention
        fp8_cache = kv_dtype == triton_decode.FP8
        if attention == "auto":  # the Triton kernel where it runs (checked by a tiny call), else matmul
            why_not = triton_decode.unavailable(self.device, kv_dtype, layout.head_dim, dtype) if self.on_gpu else "CPU"
            if fp8_cache and why_not is not None:  # only the Triton kernel reads an FP8 cache
                raise ValueError(
                    f"generation.kv_dtype=fp8 is not possible here: the Triton decode attention that reads it cannot "
                    f"run ({why_not}); use kv_dtype=auto"
                )
            attention = "triton" if why_not is None else "matmul"
            if self.on_gpu and why_not is not None:
                log.warning("generation.decode_attention=auto takes matmul: the Triton kernel cannot run (%s)", why_not)
        self.decode_attention = attention
        why_not = None
        if attention == "flash":
            why_not = flash_decode_unavailable(kv_dtype, layout.head_dim, self.device)
        elif attention == "triton" and gen_cfg.decode_attention == "triton":
            why_not = triton_decode.unavailable(self.device, kv_dtype, layout.head_dim, dtype)
        if why_not is not None:
            fix = "use kv_dtype=auto (only this kernel reads an FP8 cache)" if fp8_cache else "use matmul"
            raise ValueError(f"generation.decode_attention={attention} is not possible here: {why_not}; {fix}")
        if fp8_cache:
            log.info("generation engine: FP8 KV cache (e4m3 keys and values, a float32 scale per slot and head)")
        fp8_weights = gen_cfg.decode_weights == "fp8"
        if fp8_weights:
            why_not = fp8.unavailable(self.device)
            if why_not is not None:
                raise ValueError(f"generation.decode_weights=fp8 is not possible here: {why_not}; use same")
        compile_ = gen_cfg.compile_elementwise == "on" or (
            gen_cfg.compile_elementwise == "auto" and self.on_gpu and triton_available()
        )
        self.decode_gemm = decode_gemm = self._choose_decode_gemm(gen_cfg.decode_gemm, tp, dtype, fp8_weights)
        decode_fp8 = None
        if fp8_weights:  # with split-K GEMMs qkv too, by the FP8 kernel (fp8.py)
            # with split-K GEMMs the Triton kernels passed their start-up checks: re-quantization by the row kernel
            split_k = decode_gemm == "splitk"
            quantize_into = rows.quantize_into if split_k else None
            decode_fp8 = fp8.DecodeFp8(self.weights, self.device, qkv=split_k, quantize_into=quantize_into)
            log.info(
                "generation engine: decode steps read FP8 copies of the MLP%s and output weights (%.2f GiB)",
                ", qkv" if decode_fp8.has_qkv else "",
                decode_fp8.nbytes() / 2**30,
            )
        self.decoder = Decoder(
            layout,
            self.weights,
            group,
            self.max_batch,
            self.max_seq,
            kv_dtype,
            self.device,
            attention,
            compile_elementwise=compile_,
            inv_freq=module.rotary_pos_emb.inv_freq if layout.family.rope else None,
            decode_fp8=decode_fp8,
            decode_gemm=decode_gemm,
            softmax_scale=config.softmax_scale,
            passed_scale=passed_channel_scale(model_cfg),
            nope_layers=model_cfg.nope_layers,
        )
        # The token choice of a step and its bookkeeping: fused into a few kernels where the layers' are (and, as
        # theirs, compiled a second time for steps of up to pdl.MAX_BATCH rows: programmatic dependent launch)
        self._choose = self._choose_pdl = choose_and_record
        if compile_:
            self._choose = torch.compile(choose_and_record, dynamic=False, fullgraph=True)
            self._choose_pdl = self._choose
            options = pdl.inductor_options(self.device)
            if options:
                self._choose_pdl = torch.compile(choose_and_record, dynamic=False, fullgraph=True, options=options)
        # ... or, for greedy choice and plain sampling, by two Triton kernels (choice.py)
        self.token_choice = self._choose_token_choice(gen_cfg.token_choice)
        self.tp_group, self.tp = group, tp
        # Ranks that must draw identical tokens: the TP group, and with PP > 1 the whole model-parallel group.
        self.seed_group = mp_group if mp_group is not None else (group if tp > 1 else None)
        self._alloc_state()
        self.use_graphs = bool(gen_cfg.cuda_graphs and self.on_gpu)
        self._capturer = CudaGraphCapturer() if self.use_graphs else None
        self._graphs: dict[tuple, Callable[[], None]] = {}  # key -> replay
        # prefill's graphs: (rows, bucketed width, first row) -> (tokens, lengths, logits of the capture, replay)
        self._prefill_graphs: dict[tuple[int, int, int], tuple] = {}
        self._kv_ptr = self.decoder.kv_ptrs()
        self._released = False
        self.last_timings: dict[str, float] = {}

    def _choose_decode_gemm(self, setting: str, tp: int, dtype: torch.dtype, fp8_weights: bool = False) -> str:
        """generation.decode_gemm: auto takes the split-K kernel on a GPU at TP=1 with 16-bit weights where its
        start-up check passes (measured faster there: docs/PERF.md), cuBLAS elsewhere; splitk is checked and
        refused with the reason where it cannot run. With FP8 decode weights the check covers the FP8 fc1 kernel."""
        if setting == "cublas" or (
            setting == "auto" and (not self.on_gpu or dtype not in (torch.bfloat16, torch.float16))
        ):
            return "cublas"
        if tp > 1:
            why_not = f"it runs at TP=1 only (tensor_model_parallel_size is {tp})"
        else:
            why_not = splitk.unavailable(self.device, dtype, fp8_weights)
        if setting == "splitk":
            if why_not is not None:
                raise ValueError(f"generation.decode_gemm=splitk is not possible here: {why_not}; use cublas")
            return setting
        if why_not is not None:  # at TP > 1 as designed; at TP=1 on a GPU the start-up check failed: say so
            (log.info if tp > 1 else log.warning)(
                "generation.decode_gemm=auto takes cuBLAS: the split-K kernel cannot run (%s)", why_not
            )
            return "cublas"
        return "splitk"

    def _choose_token_choice(self, setting: str) -> str:
        """generation.token_choice: auto takes the Triton kernels on a GPU where their start-up check passes, torch's
        function (compiled where the elementwise kernels are) elsewhere; triton is checked and refused with the
        reason where it cannot run."""
        if setting == "torch" or (setting == "auto" and not self.on_gpu):
            return "torch"
        why_not = choice.unavailable(self.device)
        if setting == "triton" and why_not is not None:
            raise ValueError(f"generation.token_choice=triton is not possible here: {why_not}; use torch")
        if why_not is not None:
            log.warning("generation.token_choice=auto takes torch's function: the Triton kernels fail (%s)", why_not)
            return "torch"
        return "triton"

    # -- static state ----------------------------------------------------------------------------------------
    def _alloc_state(self):
        Bm, R, dev = self.max_batch, self.max_new, self.device
        self.cur_tok_B = torch.zeros(Bm, dtype=torch.long, device=dev)
        self.pos_B = torch.zeros(Bm, dtype=torch.long, device=dev)
        self.step_t = torch.zeros(1, dtype=torch.long, device=dev)
        self.ended_B = torch.zeros(Bm, dtype=torch.bool, device=dev)
        self.lengths_B = torch.zeros(Bm, dtype=torch.long, device=dev)
        self.out_tokens_BR = torch.zeros(Bm, R, dtype=torch.long, device=dev)
        self.out_logp_BR = torch.zeros(Bm, R, dtype=torch.float32, device=dev)
        self.u_BR = torch.zeros(Bm, R, dtype=torch.float32, device=dev)  # top-k / top-p: inverse CDF
        self.key_B = torch.zeros(Bm, dtype=torch.long, device=dev)  # plain sampling: the Gumbel noise's keys
        self.end_mask_V = torch.zeros(self.layout.vocab_size, dtype=torch.bool, device=dev)
        self.temperature_t = torch.ones((), dtype=torch.float32, device=dev)
        self.top_p_t = torch.ones((), dtype=torch.float32, device=dev)
        self.min_new_t = torch.zeros(1, dtype=torch.long, device=dev)
        self.pad_t = torch.zeros((), dtype=torch.long, device=dev)

    # -- one step ------------------------------------------------------------------------------------------
    def _sample_and_record(self, logits_local_BV: torch.Tensor, B: int, mode: tuple) -> None:
        """Draw token `step_t` for every sample and update the state; device-only (graph-safe)."""
        greedy, top_k, use_top_p = mode
        choose = self._choose_pdl if B <= pdl.MAX_BATCH else self._choose
        if self.token_choice == "triton" and not (top_k or use_top_p):
            choose = choice.choose_and_record
        choose(
            self.decoder.gather_vocab(logits_local_BV),
            self.layout.vocab_size,
            self.temperature_t,
            self.u_BR[:B],
            self.key_B[:B],
            self.step_t,
            self.min_new_t,
            self.top_p_t,
            self.end_mask_V,
            self.ended_B[:B],
            self.pad_t,
            self.out_tokens_BR[:B],
            self.out_logp_BR[:B],
            self.lengths_B[:B],
            self.cur_tok_B[:B],
            self.pos_B[:B],
            greedy=greedy,
            top_k=top_k,
            use_top_p=use_top_p,
        )

    def _decode_step(self, B: int, kv_len: int, mode: tuple, grouped: bool) -> None:
        logits = self.decoder.decode(self.cur_tok_B[:B], self.pos_B[:B], kv_len, grouped)
        self._sample_and_record(logits, B, mode)

    def _kv_len(self, needed: int) -> int:
        if self.decode_attention == "triton":  # reads each sample's own filled slots: one length (and graph) for all
            return self.max_seq
        block = self.cfg.kv_block
        return min(self.max_seq, -(-needed // block) * block)

    # -- CUDA graphs -----------------------------------------------------------------------------------------
    def _prefill(self, tokens_BT: torch.Tensor, lengths_B: torch.Tensor, row0: int) -> torch.Tensor:
        """Prefill of one row chunk: its logits [rows, V_pad/TP]. With CUDA graphs, a chunk of up to
        generation.prefill_graph_max_tokens tokens (its width rounded up to PREFILL_WIDTH_STEP, at most
        max_prompt_length) replays a graph captured for its shape: a prefill of ~16 layers is a few hundred launches
        whose host time (11-22 ms on the H200's host for 64 prompts of 128 tokens, against ~20 ms of kernels:
        docs/PERF.md, twenty-third session) otherwise sets its pace. The extra columns are padding after every
        prompt: causal attention keeps them out of each prompt's own positions, and the cache slots they fill lie
        past each prompt's length, where every decode step writes before it reads. The graphs keep their
        activations' memory (the decode graphs' pool) between calls: not with release_kv_cache, whose point is to
        give the memory to training. TP=1 only: prefill's all-reduces inside a graph have not run on GPUs yet."""
        n, T = tokens_BT.shape
        width = min(-(-T // PREFILL_WIDTH_STEP) * PREFILL_WIDTH_STEP, self.cfg.max_prompt_length)
        graphs = self.use_graphs and not self.cfg.release_kv_cache and self.tp == 1
        if not graphs or n * width > self.cfg.prefill_graph_max_tokens:
            return self.decoder.prefill(tokens_BT, lengths_B, row0=row0)
        key = (n, width, row0)
        if key not in self._prefill_graphs:
            # warm-up and capture from valid scratch prompts (they write the cache rows; the real prefill rewrites
            # them); the same keys in the same order on every TP rank, as the decode graphs
            tok = torch.zeros((n, width), dtype=torch.long, device=self.device)
            lens = torch.ones(n, dtype=torch.long, device=self.device)
            logits: list[torch.Tensor] = []  # the last call's: at the end, the captured graph's output

            def step():
                logits[:] = [self.decoder.prefill(tok, lens, row0=row0)]

            self._prefill_graphs[key] = (tok, lens, logits, self._capturer.capture(step))
        tok, lens, logits, replay = self._prefill_graphs[key]
        tok[:, T:].zero_()
        tok[:, :T].copy_(tokens_BT)
        lens.copy_(lengths_B)
        replay()
        # a copy outside the graphs' shared memory pool: the next chunk's graph may reuse these bytes
        return logits[0].clone()

    def _ensure_graphs(self, B: int, prompt_max: int, max_new: int, mode: tuple, grouped: bool) -> None:
        keys = sorted({(B, self._kv_len(prompt_max + s), mode, grouped) for s in range(1, max_new)})
        for key in keys:  # the same order on every TP rank: collectives inside are captured in lockstep
            if key in self._graphs:
                continue
            # Warm-up and capture run on scratch state (valid indices); generate() resets the state afterwards.
            for t in (self.step_t, self.pos_B, self.cur_tok_B, self.ended_B):
                t.zero_()
            self._graphs[key] = self._capturer.capture(partial(self._decode_step, *key))

    # -- public API ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompt_tokens_BT: torch.Tensor, prompt_lengths_B: torch.Tensor, sampling: SamplingParams
    ) -> GenerationOutput:
        if self._released:
            raise RuntimeError("the KV cache was released (release_memory): call acquire_memory() before generate")
        B, T = prompt_tokens_BT.shape
        V = self.layout.vocab_size
        sampling.validate(B, V, self.max_new)
        if not 1 <= B <= self.max_batch:
            raise ValueError(
                f"batch of {B} prompts: the engine was built for 1..{self.max_batch} "
                "(generation.max_batch_size); split the batch or rebuild the engine"
            )
        if tuple(prompt_lengths_B.shape) != (B,):
            raise ValueError(f"prompt_lengths_B has shape {tuple(prompt_lengths_B.shape)}, expected ({B},)")
        lengths_host = prompt_lengths_B.tolist()  # the setup's first host sync
        prompt_max = max(lengths_host)
        if min(lengths_host) < 1 or prompt_max > T:
            raise ValueError(
                f"prompt lengths must be in [1, {T}] (the padded width), got {min(lengths_host)}..{prompt_max}"
            )
        if prompt_max > self.cfg.max_prompt_length:
            raise ValueError(
                f"a prompt of {prompt_max} tokens exceeds generation.max_prompt_length="
                f"{self.cfg.max_prompt_length}: truncate prompts or rebuild the engine"
            )
        tokens = prompt_tokens_BT[:, :prompt_max].to(self.device, torch.long)
        lengths = prompt_lengths_B.to(self.device, torch.long)
        real = torch.arange(prompt_max, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        out_of_range = (((tokens < 0) | (tokens >= V)) & real).any()
        tokens = torch.where(real, tokens, 0)  # padding may hold anything (e.g. -100): feed token 0 there
        # A row whose prompt is its upper neighbour's (a group's samples: n_samples_per_prompt > 1) is not prefilled:
        # its cache rows and first logits are copied from the group's first row (generation.prefill_repeats_once)
        new_prompt_B = torch.ones(B, dtype=torch.bool, device=self.device)
        if self.cfg.prefill_repeats_once and B > 1:
            new_prompt_B[1:] = (lengths[1:] != lengths[:-1]) | (tokens[1:] != tokens[:-1]).any(dim=1)
        flags = torch.cat([out_of_range.view(1), new_prompt_B]).tolist()  # the setup's second (and last) host sync
        if flags[0]:
            raise ValueError(f"prompt tokens must be in [0, {V}) (model.vocab_size)")
        firsts = [b for b, new in enumerate(flags[1:]) if new]
        max_new = sampling.max_new_tokens or self.max_new
        top_k = sampling.top_k if 0 < sampling.top_k < V else 0
        mode = (bool(sampling.greedy), top_k, sampling.top_p < 1.0)
        grouped = len(firsts) < B  # rows repeat the prompt above them (set_prompt_groups)

        if self.use_graphs:
            self._ensure_graphs(B, prompt_max, max_new, mode, grouped)
        self._set_sampling(sampling, B, max_new, inverse_cdf=bool(top_k) or mode[2])
        self.ended_B.zero_()
        self.lengths_B.zero_()
        self.step_t.zero_()
        self.pos_B[:B] = lengths - 1  # _sample_and_record advances it to the first response slot

        timer = _Timer(self.on_gpu)
        logits = self._prefill_prompts(tokens, lengths, firsts, new_prompt_B, prompt_max)
        self._sample_and_record(logits, B, mode)
        timer.mark("prefill")

        steps = 1
        for s in range(1, max_new):
            if s % self.cfg.check_done_every == 0 and bool(self.ended_B[:B].all()):
                break
            key = (B, self._kv_len(prompt_max + s), mode, grouped)
            if self.use_graphs:
                self._graphs[key]()
            else:
                self._decode_step(*key)
            steps += 1
        timer.mark("decode")
        self.last_timings = {**timer.result(), "decode_steps": steps - 1, "prefill_prompts": len(firsts)}

        R = max(1, int(self.lengths_B[:B].max()))
        return GenerationOutput(
            response_tokens_BR=self.out_tokens_BR[:B, :R].clone(),
            response_lengths_B=self.lengths_B[:B].clone(),
            logprobs_BR=self.out_logp_BR[:B, :R].clone(),
            ended_B=self.ended_B[:B].clone(),
        )

    def _prefill_prompts(self, tokens_BT, lengths_B, firsts: list[int], new_prompt_B, prompt_max: int) -> torch.Tensor:
        """Prefill in row chunks; the logits of each row's last prompt token [B, V_pad/TP]. Only the rows `firsts`
        (where a prompt differs from the row above; all rows when none repeats) are prefilled, into cache rows
        [0, len(firsts)); then every row takes its prompt's cache slots and logits from there (`new_prompt_B`'s
        running count names the source row, never below the row itself: the copy goes through a gathered temporary).
        For GRPO's 8 samples a prompt at 512 rows this prefills 64 rows instead of 512 and copies the prompts' slots
        of the cache (at 1B, 16 layers of keys and values at 128 slots: 2.1 GB in e4m3, 4.3 in bf16; a few ms)."""
        B, n = tokens_BT.shape[0], len(firsts)
        if n < B:
            at = torch.tensor(firsts, device=self.device)
            tokens_BT, lengths_nB = tokens_BT[at], lengths_B[at]
        else:
            lengths_nB = lengths_B
        rows = max(1, self.cfg.prefill_max_tokens // prompt_max)
        chunks = [self._prefill(tokens_BT[r : r + rows], lengths_nB[r : r + rows], r) for r in range(0, n, rows)]
        logits = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        if n < B:
            source_B = torch.cumsum(new_prompt_B, dim=0) - 1
            self.decoder.copy_cache_rows(source_B, prompt_max)
            logits = logits.index_select(0, source_B)
        self.decoder.set_prompt_groups(new_prompt_B if n < B else None, lengths_B)
        return logits

    def _set_sampling(self, sampling: SamplingParams, B: int, max_new: int, inverse_cdf: bool) -> None:
        """The call's sampling state; `inverse_cdf` (top-k or top-p): each sample's uniforms, else its Gumbel key."""
        self.temperature_t.fill_(float(sampling.temperature))
        self.top_p_t.fill_(float(sampling.top_p))
        self.min_new_t.fill_(int(sampling.min_new_tokens))
        self.pad_t.fill_(int(sampling.pad_token_id))
        self.end_mask_V.zero_()
        ends = sampling.end_token_ids()
        if ends:
            self.end_mask_V[torch.tensor(ends, device=self.device)] = True
        if sampling.greedy:
            return
        seeds = self._seeds(sampling, B)
        if inverse_cdf:
            self.u_BR[:B, :max_new] = uniforms_for_seeds(seeds, max_new).to(self.device)
        else:
            self.key_B[:B] = keys_for_seeds(seeds).to(self.device)

    def _seeds(self, sampling: SamplingParams, B: int) -> list[int]:
        if sampling.seeds is not None:
            return [int(s) for s in sampling.seeds]
        base = sampling.seed
        if base is None:
            # Drawn here, then rank 0's value shared: TP (and PP) ranks must draw identical tokens.
            base_t = torch.randint(0, 2**62, (1,), device=self.device)
            if self.seed_group is not None:
                import torch.distributed as dist

                dist.broadcast(base_t, src=dist.get_global_rank(self.seed_group, 0), group=self.seed_group)
            base = int(base_t)
        return [base + b for b in range(B)]

    def refit(self, policy) -> None:
        """Copy the policy's current weights into the engine's buffers (same storage before and after); with shared
        weights only a check that the policy's storage is where the captured graphs read it."""
        if self.weights.refit(unwrap_policy(policy)):
            self._drop_graphs()  # they read the old addresses; re-captured on the next generate
        if self.decoder.fp8 is not None:
            self.decoder.fp8.requantize(self.weights)  # the same buffers: graphs stay valid

    def release_memory(self) -> None:
        """Free the KV cache (the largest buffer) so training can use the memory; weights and graphs stay."""
        self.decoder.free_kv()
        self._released = True
        if self.on_gpu:
            torch.cuda.empty_cache()

    def acquire_memory(self) -> None:
        if not self._released:
            return
        self.decoder.alloc_kv()
        self._released = False
        if self.decoder.kv.data_ptr() != self._kv_ptr:
            self._drop_graphs()  # they address the old cache; re-captured on the next generate
            self._kv_ptr = self.decoder.kv_ptrs()

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._prefill_graphs.clear()
        if self._capturer is not None:
            self._capturer.reset()

    def close(self) -> None:
        """Drop the CUDA graphs and the KV cache (see interfaces.py: before the process groups are destroyed)."""
        self._drop_graphs()
        self.decoder.free_kv()
        self._released = True
        if self.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # -- introspection (tests, benchmarks) -------------------------------------------------------------------
    def buffer_data_ptrs(self) -> dict[str, int]:
        """Every buffer a captured graph may address: weights, KV cache, step state."""
        ptrs = {f"weight:{k}": v for k, v in self.weights.data_ptrs().items()}
        if self.decoder.fp8 is not None:
            ptrs.update(self.decoder.fp8.data_ptrs())
        if self.decoder.kv is not None:
            ptrs["kv_cache"] = self.decoder.kv.data_ptr()
        if self.decoder.kv_scale is not None:
            ptrs["kv_scale"] = self.decoder.kv_scale.data_ptr()
        for name in (
            "cur_tok_B", "pos_B", "step_t", "ended_B", "lengths_B", "out_tokens_BR", "out_logp_BR", "u_BR", "key_B",
        ):  # fmt: skip
            ptrs[name] = getattr(self, name).data_ptr()
        return ptrs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


class CudaGraphCapturer:
    """Captures a step function into a CUDA graph (after warm-up on a side stream, as PyTorch requires) and returns
    its replay. All graphs share one memory pool: they never run concurrently."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.reset()

    def reset(self) -> None:
        """A new pool, for graphs captured after every earlier graph was dropped (a pool whose graphs are all gone
        is freed by PyTorch's allocator and cannot be captured into again)."""
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        return graph.replay


class _Timer:
    """Phase times in ms: CUDA events on GPU (no sync until `result`), wall clock on CPU."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        self.marks = [("start", self._now())]

    def _now(self):
        if self.gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, name: str) -> None:
        self.marks.append((name, self._now()))

    def result(self) -> dict[str, float]:
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            if self.gpu:
                b.synchronize()
                out[f"{name}_ms"] = a.elapsed_time(b)
            else:
                out[f"{name}_ms"] = (b - a) * 1e3
        return out
