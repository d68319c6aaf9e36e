"""Side-by-side tables of two result records (HF loop, aligner) and the per-step speed-up.

`compare(hf, al)` -> (rows, problems): one row per phase, the step, tokens/s and memory; problems lists workload
differences (which make the speed-up meaningless). `text_table` and `markdown_table` render the rows; the markdown is
what docs/PERF.md records. Pure Python.
"""

from __future__ import annotations

from benchmarks.ppo_step.workload import PHASES

GOAL_SPEEDUP = 2.0
LABELS = {
    "generate": "generate",
    "logprobs": "log-probs (policy, reference)",
    "values_rewards": "values + rewards (critic, reward model)",
    "critic_wait": "critic wait (values; critic update)",
    "reward_wait": "reward wait (reward function)",
    "advantages": "advantages (KL rewards, GAE or group baseline, whitening)",
    "train": "policy update",
    "refit": "refit (policy -> engine)",
    "critic_train": "critic update",
    "other": "other (unphased)",
}
# What aligner's actor cannot time because the critic job does it concurrently (its wait is in critic_wait).
IN_CRITIC_JOB = ("values_rewards", "critic_train")


def _cell(record: dict, phase: str) -> str:
    value = record["phases_s"].get(phase)
    if value is not None:
        return f"{value:.3f}"
    if record["mode"] == "aligner" and phase in IN_CRITIC_JOB:
        return "critic job"
    return "-"


def _gb(record: dict, key: str) -> str:
    value = (record.get("memory") or {}).get(key)
    return "-" if value is None else f"{value:.1f}"


def compare(hf: dict, al: dict) -> tuple[list[list[str]], list[str]]:
    problems = []
    for name, record, mode in (("first", hf, "hf"), ("second", al, "aligner")):
        if record.get("mode") != mode:
            problems.append(f"the {name} file is mode {record.get('mode')!r}, expected {mode!r} (order: hf, aligner)")
    wh, wa = hf["workload"], al["workload"]
    for key in sorted(set(wh) | set(wa)):
        if key != "gen_batch" and wh.get(key) != wa.get(key):
            problems.append(f"workload.{key}: HF {wh.get(key)!r} vs aligner {wa.get(key)!r}")
    rows = [["phase", "HF loop (s)", "aligner (s)"]]
    for phase in (*PHASES, "other"):
        if phase in hf["phases_s"] or phase in al["phases_s"]:
            rows.append([LABELS[phase], _cell(hf, phase), _cell(al, phase)])
    rows += [
        ["step", f"{hf['step_s']:.3f}", f"{al['step_s']:.3f}"],
        ["rollout tokens/s (of step time)", f"{hf['tokens_per_s']:,.0f}", f"{al['tokens_per_s']:,.0f}"],
        ["rollout tokens/s per GPU (GPUs)", _per_gpu(hf), _per_gpu(al)],
        [
            "generated tokens/s (of generate)",
            f"{hf['generated_tokens_per_s']:,.0f}",
            f"{al['generated_tokens_per_s']:,.0f}",
        ],
        ["generate batch", str(wh["gen_batch"]), str(wa["gen_batch"])],
        ["peak GPU memory, all processes (GB)", _gb(hf, "gpu_mem_peak_gb"), _gb(al, "gpu_mem_peak_gb")],
        ["peak allocated by torch (GB)", _gb(hf, "torch_peak_allocated_gb"), _gb(al, "torch_peak_allocated_gb")],
    ]
    return rows, problems


def _per_gpu(record: dict) -> str:
    """Throughput per occupied GPU, with their number ("-" on the CPU and in records older than the field)."""
    per_gpu = record.get("tokens_per_s_per_gpu")
    return f"{per_gpu:,.0f} ({record['gpus']})" if per_gpu else "-"


def speedup(hf: dict, al: dict) -> float:
    return hf["step_s"] / al["step_s"]


def describe(record: dict) -> str:
    w = record["workload"]
    hf_config = record.get("settings", {}).get("hf_config")
    shape = f"the shape of {hf_config}: " if hf_config else ""
    return (
        f"{w['rollouts']} rollouts ({w.get('samples_per_prompt', 1)} per prompt) x ({w['prompt_len']} prompt + "
        f"{w['response_len']} generated tokens), {shape}"
        f"{w['num_layers']} layers, hidden {w['hidden_size']}, {w['num_attention_heads']} heads, "
        f"{w['num_query_groups']} KV groups, FFN {w['ffn_hidden_size']}, vocab {w['vocab_size']}, {w['dtype']}; "
        f"micro-batches of {w['micro_batch']}, {w['num_mini_batches']} mini-batch(es) x {w['epochs']} epoch(s); "
        f"mean of {record['timed_steps']} timed steps after {record['warmup_steps']} warm-up; "
        f"device {record.get('device', '?')}"
    )


def overrides(record: dict) -> list[str]:
    """A line naming the KEY=VALUE overrides the jobs of `record` ran with (micro-batch sizes, generation settings:
    what `describe`'s workload line does not show), or none."""
    settings = record.get("settings", {})
    named = [f"{job} {' '.join(given)}" for job in ("actor", "critic") if (given := settings.get(f"{job}_overrides"))]
    return [f"{record['mode']} ran with overrides: " + "; ".join(named)] if named else []


def verdict(hf: dict, al: dict, problems: list[str]) -> str:
    if problems:
        return "speed-up: not comparable (" + "; ".join(problems) + ")"
    s = speedup(hf, al)
    return f"speed-up per step: {s:.2f}x (goal >= {GOAL_SPEEDUP:g}x: {'PASS' if s >= GOAL_SPEEDUP else 'FAIL'})"


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows
    )


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "| --- | " + " | ".join("---:" for _ in rows[0][1:]) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def render(hf: dict, al: dict) -> tuple[str, bool]:
    """The full report (text table, verdict, markdown block) and whether the two records are comparable."""
    rows, problems = compare(hf, al)
    notes = (
        "aligner: the critic job computes values/rewards while the actor computes log-probs, and trains while "
        "the actor trains, on the same GPU; the actor's 'critic wait' is the part not hidden."
    )
    out = [
        describe(hf),
        *overrides(al),
        "",
        text_table(rows),
        "",
        verdict(hf, al, problems),
        notes,
        "",
        "markdown for docs/PERF.md:",
        "",
        markdown_table(rows),
        "",
        verdict(hf, al, problems),
    ]
    return "\n".join(out), not problems


def render_single(record: dict) -> str:
    """One record with no HF loop to compare with (the GRPO mode, or a shape of --hf-config): its phases, step,
    throughput and checks."""
    rows = [["phase", f"{record['mode']} (s)"]]
    for phase in (*PHASES, "other"):
        if phase in record["phases_s"]:
            rows.append([LABELS[phase], f"{record['phases_s'][phase]:.3f}"])
    rows += [
        ["step", f"{record['step_s']:.3f}"],
        ["rollout tokens/s (of step time)", f"{record['tokens_per_s']:,.0f}"],
        ["rollout tokens/s per GPU (GPUs)", _per_gpu(record)],
        ["generated tokens/s (of generate)", f"{record['generated_tokens_per_s']:,.0f}"],
        ["peak GPU memory, all processes (GB)", _gb(record, "gpu_mem_peak_gb")],
    ]
    checks = record.get("checks", {})
    lines = [describe(record), *overrides(record), "", text_table(rows), ""]
    lines += [f"check {k}: {v}" for k, v in checks.items()]
    lines += ["", "markdown for docs/PERF.md:", "", markdown_table(rows)]
    return "\n".join(lines)
