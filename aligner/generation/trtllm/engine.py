"""TensorRT-LLM backend behind the same `GenerationEngine` interface (NeMo-Aligner's approach): build once, refit.

STATUS: written against TensorRT-LLM's Python API (0.1x: `tensorrt_llm.build`, `BuildConfig(use_refit=True)`,
`models.LLaMAForCausalLM`, `runtime.ModelRunner`, TensorRT's `Refitter`) but NEVER RUN: TensorRT-LLM cannot be
installed on the machines this project is developed on. Only the weight conversion (`trtllm_llama_weights`, pure
tensor reshaping) is tested here, on CPU. Check on a cluster that has TensorRT-LLM before relying on it, in particular
the weight names, the gated-MLP naming (TensorRT-LLM's `mlp.fc` / `mlp.gate`), whether its returned log-probs are
taken after temperature (the contract requires log_softmax(logits / temperature)), and per-sample seeds.

Contract as in aligner.generation.interfaces, with these differences:
- Llama family only; PP=1; the engine is built in memory from the policy's current TP shard (no checkpoint on disk)
  with max batch / input / sequence length from GenerationConfig, and `refit` pushes the policy's tensors to the
  engine's refittable weights (TensorRT `Refitter` with device pointers), never rebuilding it.
- TensorRT-LLM runs its own NCCL communicator over the same ranks as megatron's TP group (same layout, so refit
  still moves no bytes across GPUs), created through its MPI world: launch with one MPI rank per GPU.
"""

from __future__ import annotations

import torch

from aligner.generation.interfaces import GenerationOutput, SamplingParams
from aligner.generation.native.weights import unwrap_policy


def _import_trtllm():
    try:
        import tensorrt as trt
        import tensorrt_llm
    except ImportError as err:
        raise ImportError(
            "generation.backend=trtllm needs the tensorrt_llm package (NVIDIA's TensorRT-LLM, e.g. in "
            "an NGC TensorRT-LLM container); it is not installed here: use generation.backend=native"
        ) from err
    return tensorrt_llm, trt


def trtllm_llama_weights(
    local: dict[str, torch.Tensor], num_layers: int, heads: int, groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """This TP rank's megatron tensors -> TensorRT-LLM LLaMA names (same TP shard, no communication).

    megatron's linear_qkv rows are grouped per KV group ([q heads of g; k_g; v_g] for each g); TensorRT-LLM's
    attention.qkv wants [all q; all k; all v]. fc1 = [gate; up] splits into mlp.fc (gate) and mlp.gate (up).
    `heads`/`groups` are this rank's counts.
    """
    r = heads // groups
    out = {
        "transformer.vocab_embedding.weight": local["embedding.word_embeddings.weight"],
        "transformer.ln_f.weight": local["decoder.final_layernorm.weight"],
        "lm_head.weight": local.get("output_layer.weight", local["embedding.word_embeddings.weight"]),
    }
    for i in range(num_layers):
        src, dst = f"decoder.layers.{i}.", f"transformer.layers.{i}."
        qkv = local[src + "self_attention.linear_qkv.weight"]
        per_group = qkv.view(groups, r + 2, head_dim, -1)
        q = per_group[:, :r].reshape(heads * head_dim, -1)
        k = per_group[:, r].reshape(groups * head_dim, -1)
        v = per_group[:, r + 1].reshape(groups * head_dim, -1)
        out[dst + "attention.qkv.weight"] = torch.cat([q, k, v], 0)
        out[dst + "attention.dense.weight"] = local[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = local[src + "input_layernorm.weight"]
        out[dst + "post_layernorm.weight"] = local[src + "pre_mlp_layernorm.weight"]
        gate, up = local[src + "mlp.linear_fc1.weight"].chunk(2, 0)
        out[dst + "mlp.fc.weight"] = gate
        out[dst + "mlp.gate.weight"] = up
        out[dst + "mlp.proj.weight"] = local[src + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}


class TrtllmEngine:
    def __init__(self, gen_cfg, model_cfg, policy):
        tensorrt_llm, trt = _import_trtllm()
        from megatron.core import parallel_state as ps

        if model_cfg.arch != "llama":
            raise NotImplementedError("the TensorRT-LLM backend covers the Llama family only: use backend=native")
        beyond = [
            name
            for name, used in (
                ("model.add_qkv_bias (Qwen2)", model_cfg.add_qkv_bias),
                ("model.qk_layernorm (Qwen3)", model_cfg.qk_layernorm),
                (
                    "model.head_dim",
                    model_cfg.head_dim not in (None, model_cfg.hidden_size // model_cfg.num_attention_heads),
                ),
                ("model.rope_scaling", model_cfg.rope_scaling is not None),
                ("model.nope_layers (SmolLM3)", bool(model_cfg.nope_layers)),
            )
            if used
        ]
        if beyond:  # the weight map below has no place for them: refuse rather than generate from another model
            raise NotImplementedError(f"the TensorRT-LLM backend does not map {', '.join(beyond)}: use backend=native")
        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("generation with PP > 1 is not supported: train the actor with PP=1")
        self.trt, self.cfg, self.model_cfg = trt, gen_cfg, model_cfg
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        module = unwrap_policy(policy)
        c = module.config
        self._shape = {
            "num_layers": c.num_layers,
            "heads": c.num_attention_heads // self.tp,
            "groups": (c.num_query_groups or c.num_attention_heads) // self.tp,
            "head_dim": c.kv_channels,
        }
        from tensorrt_llm import BuildConfig, Mapping, build
        from tensorrt_llm.models import LLaMAForCausalLM
        from tensorrt_llm.runtime import ModelRunner

        mapping = Mapping(world_size=self.tp, rank=self.tp_rank, tp_size=self.tp)
        model = LLaMAForCausalLM.from_config(
            tensorrt_llm.models.PretrainedConfig.from_dict(
                {
                    "architecture": "LlamaForCausalLM",
                    "dtype": "bfloat16",
                    "num_hidden_layers": c.num_layers,
                    "num_attention_heads": c.num_attention_heads,
                    "num_key_value_heads": c.num_query_groups,
                    "hidden_size": c.hidden_size,
                    "intermediate_size": c.ffn_hidden_size,
                    "vocab_size": module.embedding.word_embeddings.weight.shape[0] * self.tp,
                    "position_embedding_type": "rope_gpt_neox",
                    "max_position_embeddings": gen_cfg.max_prompt_length + gen_cfg.max_response_length,
                    "hidden_act": "silu",
                    "norm_epsilon": c.layernorm_epsilon,
                    "rotary_base": model_cfg.rotary_base,
                    "mapping": {"world_size": self.tp, "tp_size": self.tp, "rank": self.tp_rank},
                }
            )
        )
        model.load(self._weights(module))
        engine = build(
            model,
            BuildConfig(
                max_batch_size=gen_cfg.max_batch_size,
                max_input_len=gen_cfg.max_prompt_length,
                max_seq_len=gen_cfg.max_prompt_length + gen_cfg.max_response_length,
                use_refit=True,
            ),
        )
        self.runner = ModelRunner.from_engine(engine, rank=mapping.rank)
        self._refitter = trt.Refitter(self.runner.session.runtime.engine, tensorrt_llm.logger.trt_logger)

    def _weights(self, module) -> dict[str, torch.Tensor]:
        local = {k: v.detach().to(torch.bfloat16) for k, v in module.named_parameters()}
        return trtllm_llama_weights(local, **self._shape)

    @torch.no_grad()
    def refit(self, policy) -> None:
        """Point TensorRT's refitter at the converted tensors (device memory) and refit the engine in place."""
        trt = self.trt
        weights = self._weights(unwrap_policy(policy))
        keep_alive = []
        for name, tensor in weights.items():
            tensor = tensor.cuda().contiguous()
            keep_alive.append(tensor)
            self._refitter.set_named_weights(
                name, trt.Weights(trt.DataType.BF16, tensor.data_ptr(), tensor.numel()), trt.TensorLocation.DEVICE
            )
        if not self._refitter.refit_cuda_engine():
            raise RuntimeError(f"TensorRT refit failed; missing weights: {self._refitter.get_missing_weights()[:5]}")
        torch.cuda.synchronize()

    def close(self) -> None:
        """Drop the TensorRT-LLM runner and refitter (and with them the engine's device memory)."""
        self._refitter = None
        self.runner = None

    @torch.no_grad()
    def generate(self, prompt_tokens_BT, prompt_lengths_B, sampling: SamplingParams) -> GenerationOutput:
        B = prompt_tokens_BT.shape[0]
        sampling.validate(B, self.model_cfg.vocab_size, self.cfg.max_response_length)
        ends = sampling.end_token_ids()
        max_new = sampling.max_new_tokens or self.cfg.max_response_length
        prompts = [prompt_tokens_BT[b, : int(n)].int() for b, n in enumerate(prompt_lengths_B.tolist())]
        seeds = list(sampling.seeds) if sampling.seeds is not None else [(sampling.seed or 0) + b for b in range(B)]
        out = self.runner.generate(
            prompts,
            max_new_tokens=max_new,
            end_id=ends[0] if ends else -1,
            pad_id=sampling.pad_token_id,
            stop_words_list=[[[t] for t in ends[1:]]] * B if len(ends) > 1 else None,
            temperature=sampling.temperature,
            top_k=1 if sampling.greedy else sampling.top_k,
            top_p=sampling.top_p if sampling.top_p < 1.0 else 0.0,
            min_length=sampling.min_new_tokens,
            random_seed=seeds,
            output_log_probs=True,
            return_dict=True,
        )
        lengths = out["sequence_lengths"][:, 0].long() - prompt_lengths_B.to(out["sequence_lengths"].device).long()
        R = int(lengths.max())
        tokens = torch.full((B, R), sampling.pad_token_id, dtype=torch.long, device=lengths.device)
        logps = torch.zeros(B, R, dtype=torch.float32, device=lengths.device)
        for b, n in enumerate(prompt_lengths_B.tolist()):
            L = int(lengths[b])
            tokens[b, :L] = out["output_ids"][b, 0, n : n + L]
            logps[b, :L] = out["log_probs"][b, 0, :L].float()
        last = tokens.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        ended = torch.isin(last, torch.tensor(ends, device=last.device)) if ends else torch.zeros_like(last, dtype=bool)
        return GenerationOutput(tokens, lengths, logps, ended)
