"""PPO step benchmark (issue 6): aligner's two jobs against a plain HF transformers loop on the same work.

    python scripts/bench_ppo_step.py --mode hf --out hf.json            # plain HF loop (numpy 2; no megatron)
    python scripts/bench_ppo_step.py --mode aligner --out aligner.json  # critic + actor jobs (megatron, PyTriton)
    python scripts/bench_ppo_step.py --report hf.json aligner.json      # both tables, the speed-up, markdown
    python scripts/bench_ppo_step.py --mode grpo --out grpo.json        # a GRPO step, the actor job alone
    add --tiny for the CPU smoke size (2 layers, hidden 64, 8 rollouts of 8 + 8 tokens)
    add --profile (aligner, grpo) to run one more step under torch.profiler, outside the means: its phase table
    add --hf-config path/to/config.json (aligner, grpo) for the same work on your own model's shape (random weights;
        in the aligner mode the critic and the reward model take the policy's shape too)

Workload (benchmarks/ppo_step/workload.py): ~1B Llama-style policy, reference, critic and reward model, 512 rollouts
of 128 prompt + 256 generated tokens (EOS ignored), micro-batches of 16, one PPO epoch. Each mode runs --steps steps
and reports the mean of those after --warmup; the JSON holds per-phase seconds, step seconds, tokens/s and memory.
The aligner mode uses conf/bench/ppo_step_{actor,critic}[_tiny].yaml (checked against the workload) and passes
--actor/--critic KEY=VALUE overrides to launchers/local/ppo.py. The grpo mode (benchmarks/ppo_step/grpo_job.py,
issue 16) runs conf/bench/grpo_step_actor[_tiny].yaml with --actor-only: 64 prompts x 8 samples of 128 + 256
tokens, KL 0.04 as a loss term against the resident reference, a reward function, no critic; it prints its phase
table, the KL at step 0 and the log-prob mismatch. Exit status: 0, 1 on a failed run, 2 on bad input (a config that
does not describe the workload, or --report files that are not comparable).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.ppo_step.workload import FULL, GRPO_FULL, GRPO_TINY, TINY, write_json  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("hf", "aligner", "grpo"))
    p.add_argument("--report", nargs=2, metavar=("HF_JSON", "ALIGNER_JSON"), help="compare two result files")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--tiny", action="store_true", help="CPU smoke size")
    p.add_argument("--steps", type=int, default=3, help="steps in all, warm-up included (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the means (default 1)")
    p.add_argument("--hf-gen-batch", type=int, default=None, help="prompts per HF generate call (default: all)")
    p.add_argument("--hf-no-compile", action="store_true", help="HF static cache without torch.compile")
    p.add_argument(
        "--exp-dir", default=None, help="aligner, grpo: a new directory for the jobs' files (default: a temp dir)"
    )
    p.add_argument("--timeout", type=float, default=480.0, help="aligner, grpo: seconds before the jobs are stopped")
    p.add_argument("--actor", nargs="*", default=[], metavar="KEY=VALUE", help="aligner, grpo: actor overrides")
    p.add_argument("--critic", nargs="*", default=[], metavar="KEY=VALUE", help="aligner: critic config overrides")
    p.add_argument(
        "--actor-gpus",
        default=None,
        metavar="LIST",
        help="aligner, grpo: GPUs of the actor job, e.g. 0 (default: the jobs see every GPU)",
    )
    p.add_argument("--critic-gpus", default=None, metavar="LIST", help="aligner: GPUs of the critic job, e.g. 1")
    p.add_argument("--actor-procs", type=int, default=1, help="aligner: actor ranks (the launcher's --actor-procs)")
    p.add_argument("--critic-procs", type=int, default=1, help="aligner: critic ranks (the launcher's --critic-procs)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="aligner, grpo: one more step under torch.profiler (not in the means): its per-phase table, the trace "
        "under EXP_DIR/actor/profile/",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="aligner, grpo: the models in the shape of this Hugging Face config.json (or its directory), random "
        "weights",
    )
    a = p.parse_args(argv)
    if bool(a.mode) == bool(a.report):
        p.error("give exactly one of --mode or --report")
    if a.hf_config and a.mode == "hf":
        p.error("--hf-config times aligner's jobs (--mode aligner or grpo): the HF loop keeps the workload's 1B models")
    if a.mode and not 0 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup} must leave at least one of --steps {a.steps} timed")
    return a


def report(paths) -> int:
    from benchmarks.ppo_step.report import render

    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    text, comparable = render(*records)
    print(text)
    return 0 if comparable else 2


def print_profile(result: dict) -> None:
    if "profile" in result:
        from aligner.utils.profiling import format_summary

        s = result["profile"]["summary"]
        print(format_summary(s, f"profiled step {s['step']} (not in the means), rank 0; trace {s['trace']}"))


def grpo(a, model) -> int:
    """The GRPO mode; `model`: the ModelConfig of --hf-config, or None for the workload's own shape."""
    from aligner.config import ConfigError
    from benchmarks.ppo_step import grpo_job
    from benchmarks.ppo_step.aligner_jobs import WorkloadMismatch
    from benchmarks.ppo_step.report import render_single
    from benchmarks.shapes import shape_overrides

    w, model_overrides = GRPO_TINY if a.tiny else GRPO_FULL, []
    if model is not None:
        w, model_overrides = w.shaped_as(model), shape_overrides(model)
    suffix = "_tiny" if a.tiny else ""
    exp_dir = a.exp_dir or tempfile.mkdtemp(prefix="bench_grpo_step_")
    try:
        result = grpo_job.run(
            w,
            a.steps,
            a.warmup,
            f"bench/grpo_step_actor{suffix}",
            os.path.abspath(exp_dir),
            a.actor,
            a.timeout,
            actor_gpus=a.actor_gpus,
            profile=a.profile,
            model_overrides=model_overrides,
            hf_config=a.hf_config,
        )
    except (ConfigError, WorkloadMismatch, FileExistsError) as exc:
        print(f"bench_ppo_step: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"bench_ppo_step: {exc}", file=sys.stderr)
        return 1
    print(render_single(result))
    print_profile(result)
    if a.out:
        write_json(a.out, result)
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    a = parse(argv)
    if a.report:
        return report(a.report)
    w, model = TINY if a.tiny else FULL, None
    if a.hf_config:
        from benchmarks.shapes import model_from_hf_config

        try:
            model = model_from_hf_config(a.hf_config)
        except ValueError as exc:
            print(f"bench_ppo_step: {exc}", file=sys.stderr)
            return 2
    if a.mode == "grpo":
        return grpo(a, model)
    if a.mode == "hf":
        from benchmarks.ppo_step import hf_loop

        if a.hf_gen_batch:
            w = w.with_(gen_batch=a.hf_gen_batch)
        result = hf_loop.run(w, a.steps, a.warmup, compile_generate=False if a.hf_no_compile else None)
    else:
        from aligner.config import ConfigError
        from benchmarks.ppo_step import aligner_jobs
        from benchmarks.shapes import shape_overrides

        # the critic job's value model and reward model take the policy's shape, as both start from it in practice
        actor_shape, critic_shape = [], []
        if model is not None:
            w, actor_shape = w.shaped_as(model), shape_overrides(model)
            critic_shape = actor_shape + shape_overrides(model, "reward_model")
        suffix = "_tiny" if a.tiny else ""
        exp_dir = a.exp_dir or tempfile.mkdtemp(prefix="bench_ppo_step_")
        try:
            result = aligner_jobs.run(
                w,
                a.steps,
                a.warmup,
                f"bench/ppo_step_actor{suffix}",
                f"bench/ppo_step_critic{suffix}",
                os.path.abspath(exp_dir),
                a.actor,
                a.critic,
                a.timeout,
                actor_gpus=a.actor_gpus,
                critic_gpus=a.critic_gpus,
                actor_procs=a.actor_procs,
                critic_procs=a.critic_procs,
                profile=a.profile,
                model_overrides=actor_shape,
                critic_model_overrides=critic_shape,
                hf_config=a.hf_config,
            )
        except (ConfigError, aligner_jobs.WorkloadMismatch, FileExistsError) as exc:
            print(f"bench_ppo_step: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:
            print(f"bench_ppo_step: {exc}", file=sys.stderr)
            return 1
    phases = ", ".join(f"{k} {v:.3f}" for k, v in result["phases_s"].items())
    per_gpu = result.get("tokens_per_s_per_gpu")
    per_gpu = f" ({per_gpu:,.0f} per GPU, {result['gpus']} GPUs)" if per_gpu else ""
    print(f"{a.mode}: step {result['step_s']:.3f} s, {result['tokens_per_s']:,.0f} tokens/s{per_gpu} ({phases})")
    if model is not None:  # another shape than the HF loop's: no --report to compare with, so the table here
        from benchmarks.ppo_step.report import render_single

        print(render_single(result))
    print_profile(result)
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main())
