"""Probe (issue 17, twenty-second session): a decode step's token choice and bookkeeping, the compiled function
(sampling.choose_and_record under torch.compile, what the engine ran) against choice.py's two Triton kernels.

A profile of an FP8 decode step at B=64 (bench_generation.py --profile) put the compiled function's eleven kernels
at about 31 us of a 1.02 ms step. Here each form is timed alone, 16 calls in one CUDA graph (the step counter
advancing as in the engine), us per call, greedy and plain sampling, at each --batches size for a 32,000-token
vocabulary (the benchmark model's), the Triton form at several chunk widths and warp counts; and whether each
records the same tokens as the compiled function.

    python3 benchmarks/probes/token_choice.py --out result.json     (CUDA; Triton)
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

VOCAB, VOCAB_PAD, STEPS = 32000, 32000, 1024


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)

    from aligner.generation.native import choice, pdl, sampling
    from benchmarks.decode_kernels import graph_time_us
    from benchmarks.ppo_step.workload import write_json

    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(dev), "vocab": VOCAB, "us": {}, "same_tokens": {}}

    def state(B, seed=0):
        return choice.random_step_state(B, VOCAB, VOCAB_PAD, STEPS, dev, seed)

    def timed(fn, B, greedy) -> float:
        s = state(B)
        return round(graph_time_us(lambda: fn(**s, greedy=greedy, top_k=0, use_top_p=False), replays=50), 2)

    for B in args.batches:
        options = pdl.inductor_options(dev) if B <= pdl.MAX_BATCH else {}
        compiled = torch.compile(sampling.choose_and_record, dynamic=False, fullgraph=True, options=options or None)
        for greedy in (True, False):
            mode = "greedy" if greedy else "sampled"
            report["us"][f"B={B} {mode} compiled"] = timed(compiled, B, greedy)
            want = state(B, 1)
            compiled(**want, greedy=greedy, top_k=0, use_top_p=False)
            for block in (2048, 4096, 8192):
                for warps in (4, 8):
                    choice.BLOCK, choice.NUM_WARPS = block, {greedy: warps}
                    name = f"B={B} {mode} triton block {block} warps {warps}"
                    report["us"][name] = timed(choice.choose_and_record, B, greedy)
                    got = state(B, 1)
                    choice.choose_and_record(**got, greedy=greedy, top_k=0, use_top_p=False)
                    report["same_tokens"][name] = bool(torch.equal(got["out_tokens_BR"], want["out_tokens_BR"]))
            for name in [n for n in report["us"] if n.startswith(f"B={B} {mode}")]:
                print(f"{name:44s} {report['us'][name]:8.2f}  {report['same_tokens'].get(name, '')}", flush=True)
    if args.out:
        write_json(args.out, report)
    print(json.dumps(report["us"]))
    return report


if __name__ == "__main__":
    main()
