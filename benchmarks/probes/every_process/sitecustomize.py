"""The probes' --set for every process of a job: `ALIGNER_PROBE_SET="triton_decode.SHARED_PREFIX=False ..."` with this
folder and the repository's root on PYTHONPATH, and each Python process started so (the benchmark, its launcher, every
rank of the jobs it starts: they inherit the environment) applies the items as the probes' --set does
(benchmarks/probes/common.apply_settings) before it runs anything, and says so on stderr. For settings of the engine
inside a job that a benchmark starts as processes of its own (scripts/bench_ppo_step.py), compared in one tree:

    ALIGNER_PROBE_SET="triton_decode.SHARED_PREFIX=False" PYTHONPATH=benchmarks/probes/every_process:. \\
        python3 scripts/bench_ppo_step.py --mode grpo ...

Python imports `sitecustomize` from the first folder on its path that has one, once at start-up. Without
ALIGNER_PROBE_SET it does nothing; a malformed item ends the process with apply_settings's message.
"""

import os
import sys

if os.environ.get("ALIGNER_PROBE_SET"):
    from benchmarks.probes.common import apply_settings

    _applied = apply_settings(os.environ["ALIGNER_PROBE_SET"].split())
    print(f"[probe settings] {' '.join(_applied)} in {' '.join(sys.argv)[:120]}", file=sys.stderr, flush=True)
