"""GPU probe (by hand, one GPU; not collected by pytest): where a resumed step differs from the uninterrupted one.

    python tests/gpu/probe_resume.py DIR [deterministic]

Runs A: step, save, step; B: fresh model, load, step; C: again fresh, load, step. Prints the largest differences of
the weights after the step (A vs B, B vs C: is the resumed run itself repeatable?), of the fp32 main parameters and
Adam moments right after the load (B) against A's before its second step, and of the gradients of that step.
With `deterministic`, SDPA's math backend and torch's deterministic algorithms are forced.
"""

import os
import sys

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def opt_state(opt):
    """fp32 main params and Adam moments of megatron's (distributed) optimizer, flattened per param, in order."""
    out = {}
    opt = getattr(opt, "inner", opt)  # aligner.models.optim.MegatronOptimizer wraps megatron's
    inner = getattr(opt, "chained_optimizers", [opt])
    for i, o in enumerate(inner):
        torch_opt = getattr(o, "optimizer", o)
        for g, group in enumerate(torch_opt.param_groups):
            for j, p in enumerate(group["params"]):
                st = torch_opt.state.get(p, {})
                out[f"{i}.{g}.{j}.main"] = p.detach().float().clone()
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        out[f"{i}.{g}.{j}.{k}"] = st[k].detach().float().clone()
    return out


def maxdiff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max().item() for k in a if k in b), default=float("nan"))


def main(root: str, deterministic: bool) -> None:
    from aligner.checkpoint import dist_ckpt
    from aligner.config import ModelConfig, OptimConfig
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    initialize(seed=1)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        ffn_hidden_size=256,
        params_dtype="bfloat16",
    )
    tokens = torch.randint(0, 100, (4, 16), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    micro = [{"tokens": tokens}]

    def loss_fn(batch, out):
        return out.float().pow(2).mean(), {}

    ocfg = OptimConfig(lr=1e-3)
    a = TrainableModel(cfg, ocfg)
    a.step(micro, loss_fn)
    path = dist_ckpt.save(root, 1, [a.module], a.optimizer, {"x": 1})
    a_state = opt_state(a.optimizer)
    a_weights = {k: v.float().clone() for k, v in a.module.state_dict().items() if torch.is_tensor(v)}
    a.step(micro, loss_fn)
    a_grads = {n: p.main_grad.float().clone() for n, p in a.module.named_parameters()}
    a_after = {k: v.float().clone() for k, v in a.module.state_dict().items() if torch.is_tensor(v)}
    res = {}
    for name in ("B", "C"):
        m = TrainableModel(cfg, ocfg)
        dist_ckpt.load(path, [m.module], m.optimizer)
        m.steps_taken = 1
        loaded_state = opt_state(m.optimizer)
        loaded_w = {k: v.float().clone() for k, v in m.module.state_dict().items() if torch.is_tensor(v)}
        m.step(micro, loss_fn)
        grads = {n: p.main_grad.float().clone() for n, p in m.module.named_parameters()}
        after = {k: v.float().clone() for k, v in m.module.state_dict().items() if torch.is_tensor(v)}
        res[name] = (loaded_state, loaded_w, grads, after)
    b, c = res["B"], res["C"]
    print(f"deterministic={deterministic}")
    print(
        f"after load: weights |A-B| {maxdiff(a_weights, b[1]):.3g}; optimizer state |A-B| "
        f"{maxdiff(a_state, b[0]):.3g} ({len(a_state)} tensors, {len(b[0])} loaded)"
    )
    for k in sorted(a_state)[:6]:
        if k in b[0]:
            print(f"   {k}: {(a_state[k] - b[0][k]).abs().max().item():.3g}")
    print(f"grads of the next step: |A-B| {maxdiff(a_grads, b[2]):.3g}  |B-C| {maxdiff(b[2], c[2]):.3g}")
    print(f"weights after the step: |A-B| {maxdiff(a_after, b[3]):.3g}  |B-C| {maxdiff(b[3], c[3]):.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:3] == ["deterministic"])
