"""The three trainers' steps with TP=2, DP=2 or PP=2 against one process: same starting checkpoint, same
global batch -> same loss metrics, gradients and validation metrics (real megatron-core on gloo, the demo data)."""

import pytest
import torch
from dist import run_ranks

TRAINERS = {
    "sft": ("aligner.config.sft:load_sft_config", "aligner.train.sft:SFTTask", "lm"),
    "reward_model": (
        "aligner.config.reward_model:load_reward_model_config",
        "aligner.train.reward_model:RewardModelTask",
        "scalar",
    ),
    "dpo": ("aligner.config.dpo:load_dpo_config", "aligner.train.dpo:DPOTask", "lm"),
}
INDICES = [5, 17, 2, 40, 33, 8, 21, 11]  # one global batch of 8 examples


def _import(spec):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _config(trainer, tmp, overrides=()):
    return _import(TRAINERS[trainer][0])(
        [
            f"--config-name={trainer}_demo",
            f"exp_dir={tmp}",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "train.val_max_examples=6",
            "optim.clip_grad=0.0",  # clipping scales the gradients in place: compare them unclipped
            "checkpoint.resume=false",
            *overrides,
        ]
    )


def _step(rank, trainer, tp, pp, tmp, start, overrides):
    """One training step and one validation pass of `trainer` on the layout (TP, PP); DP fills the world."""
    from megatron.core import parallel_state

    from aligner.models.sharding import full_state_dict
    from aligner.parallel import initialize

    if parallel_state.model_parallel_is_initialized():  # several layouts, one after the other, in one process
        parallel_state.destroy_model_parallel()
    initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=7)
    cfg = _config(
        trainer,
        f"{tmp}/run{rank}",
        [
            f"model.checkpoint={start}",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            *overrides,
        ],
    )
    task = _import(TRAINERS[trainer][1])(cfg)
    metrics = task.train_step(INDICES)
    grads = full_state_dict(task.model.module, cfg.model, grads=True)
    metrics.update(task.validate())
    return {"metrics": metrics, "grads": grads}


def _one_process(rank, world, tmp):
    """Per trainer: a model with its head saved as the starting checkpoint; then the reference step of every case."""
    from aligner.checkpoint import dist_ckpt
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    initialize(seed=3)
    starts = {}
    for trainer in TRAINERS:
        cfg = _config(trainer, tmp)
        model = build_gpt(cfg.model, head=TRAINERS[trainer][2])
        starts[trainer] = dist_ckpt.save(f"{tmp}/start-{trainer}", 0, [model], model_cfg=cfg.model)
    refs = {(t, o): _step(rank, t, 1, 1, f"{tmp}/one", starts[t], o) for t, _, _, o in CASES}
    return starts, refs


def _two_ranks(rank, world, tmp, starts):
    return {case: _step(rank, case[0], case[1], case[2], f"{tmp}/two", starts[case[0]], case[3]) for case in CASES}


CASES = [  # trainer, TP, PP, overrides (DP = 2 / (TP * PP))
    ("sft", 2, 1, ()),
    ("sft", 1, 2, ()),
    ("sft", 1, 1, ("data.packing=false",)),  # DP=2, length-bucketed micro-batches
    ("sft", 2, 1, ("data.packed_attention=varlen", "model.sequence_parallel=true")),  # the samples' starts
    ("reward_model", 2, 1, ()),
    ("reward_model", 1, 2, ()),
    ("dpo", 2, 1, ()),
    ("dpo", 1, 1, ("dpo.reference=precomputed",)),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two spawns for the whole file (starting a process is most of the cost): one process, then two ranks."""
    tmp = str(tmp_path_factory.mktemp("trainers"))
    starts, refs = run_ranks(_one_process, 1, tmp)[0]
    return refs, run_ranks(_two_ranks, 2, tmp, starts, timeout=900)


@pytest.mark.parametrize("trainer, tp, pp, overrides", CASES)
def test_two_ranks_match_one_process(trainer, tp, pp, overrides, runs):
    refs, results = runs
    ref = refs[(trainer, overrides)]
    results = [r[(trainer, tp, pp, overrides)] for r in results]
    for r in results:
        assert r["metrics"].keys() == ref["metrics"].keys()
        for key, value in ref["metrics"].items():
            if key.startswith("timing/"):
                continue
            if key == "train/padding_fraction":  # DP ranks pack their own halves: a different amount of padding
                continue
            assert r["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        for name, g in ref["grads"].items():
            mine = r["grads"][name]
            if name == "output_layer.weight" and TRAINERS[trainer][2] == "scalar" and tp > 1:
                # full_state_dict gathers an output layer as vocabulary shards; the scalar head is replicated
                torch.testing.assert_close(mine[1:], mine[:1], rtol=0, atol=0)
                mine = mine[:1]
            torch.testing.assert_close(mine, g, rtol=1e-4, atol=1e-6, msg=f"grad of {name}")
    assert ref["metrics"]["train/loss"] > 0
