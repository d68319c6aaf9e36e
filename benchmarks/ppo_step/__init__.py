"""The PPO-step benchmark (scripts/bench_ppo_step.py): aligner's two jobs against a plain HF transformers loop.

Contract
- `workload.Workload` is the one description of the work both sides do per step (model shape, rollouts, prompt and
  response lengths, micro-batch, mini-batches, epochs); `FULL` is the issue's ~1B setting, `TINY` a CPU smoke size.
- `hf_loop.run(workload, ...)` (mode `hf`) runs the plain single-process loop; it imports torch, transformers and
  `aligner.rl` only, never megatron, omegaconf or PyTriton, so it runs under numpy 2.
- `aligner_jobs.run(workload, ...)` (mode `aligner`) starts the critic and actor jobs with launchers/local/ppo.py
  on conf/bench/ configs and reads the actor's metrics.jsonl; it first checks that the configs describe the same
  workload and fails naming the key if not.
- Both return a result dict (`workload.result(...)`): per-phase mean seconds over the timed steps (the warm-up steps
  are dropped), step seconds, rollout tokens per second of step time, memory, per-step raw timings.
  `report.render(hf, aligner)` gives both tables side by side, the speed-up and the markdown for docs/PERF.md.
Nothing here asserts on time; the tests check the code paths and the JSON keys.
"""
