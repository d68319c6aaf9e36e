"""benchmarks/probes/decode_ablation.py on the CPU with bench_generation's tiny model and the Triton decode attention
under Triton's interpreter: the replaced piece is answered from its memo, the other targets' functions are put back."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks.probes import decode_ablation  # noqa: E402


def test_the_replaced_piece_is_answered_from_its_memo(tmp_path):
    from dist import free_port

    from aligner.generation.native import triton_decode
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    real = triton_decode.decode_attention
    argv = ["--tiny", "--repeats", "1", "--batch-sizes", "2", "--decode-attention", "triton", "--out"]
    report = decode_ablation.main([*argv, str(tmp_path / "r.json"), "--targets", "none", "attention", "proj"])
    assert (tmp_path / "r.json").exists() and report["device"] == "cpu"
    assert report["engine"]["decode_attention"] == "triton" and report["engine"]["decode_gemm"] == "cublas"
    assert triton_decode.decode_attention is real  # put back
    targets = report["targets"]
    # every decode call of every layer after the first of its shapes: from the memo; proj's split-K kernel does not
    # run on the CPU (decode_gemm: cublas), so nothing of it is replaced
    assert targets["attention"]["calls_replaced"] > 0
    assert targets["none"]["calls_replaced"] == 0 and targets["proj"]["calls_replaced"] == 0
    assert all(t["batches"]["2"]["median"] > 0 for t in targets.values())
    with pytest.raises(SystemExit):
        decode_ablation.main(["--tiny", "--targets", "mlp"])


def test_compiled_kernels_and_the_decoders_gemm_are_targets_too(tmp_path):
    """The pieces of steps above 128 rows (cuBLAS and compiled kernels), here the CPU's path with FP8 decode weights:
    the activation's compiled kernel (a field of the decoder's kernels), the output layer's row-wise scaled GEMM (a
    module function) and proj's GEMM (a static method of the Decoder, put back afterwards)."""
    from dist import free_port

    from aligner.generation.native.decoder import Decoder
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    real = Decoder.__dict__["_linear"]
    argv = ["--tiny", "--repeats", "1", "--batch-sizes", "2", "--decode-weights", "fp8", "--out"]
    targets = ["none", "act_q", "rowwise_fp8", "linear"]
    report = decode_ablation.main([*argv, str(tmp_path / "r.json"), "--targets", *targets])
    assert Decoder.__dict__["_linear"] is real
    replaced = {t: report["targets"][t]["calls_replaced"] for t in targets}
    assert replaced["none"] == 0 and all(replaced[t] > 0 for t in targets[1:]), replaced
