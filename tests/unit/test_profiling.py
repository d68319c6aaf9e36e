"""The step profiler (logging.profile_step): busy time by hand, a real CPU profile of timed phases, the config key."""

import gzip
import json
import os
import time

import pytest
import torch

from aligner.config import ConfigError
from aligner.config.actor import ActorJobConfig
from aligner.utils.metrics import Timer
from aligner.utils.profiling import StepProfiler, busy_time, kind_of, profiler_for


def test_busy_time_is_the_union_of_intervals_inside_the_window():
    intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]  # two overlapping streams, then a gap
    assert busy_time(intervals, 0.0, 10.0) == 4.0
    assert busy_time(intervals, 2.0, 5.5) == 1.5  # clipped at both ends
    assert busy_time(intervals, 3.0, 5.0) == 0.0
    assert busy_time([], 0.0, 1.0) == 0.0


def test_kernel_kinds_from_names():
    assert kind_of("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kind_of("triton_red_fused__fused_rms_norm_add_0") == "norm"
    assert kind_of("aten::add_") == "other elementwise"


def test_a_profiled_step_writes_a_trace_and_a_summary_of_its_phases(tmp_path):
    timer = Timer()
    a = torch.randn(256, 256)
    with StepProfiler(str(tmp_path), step=3, rank=0, gpu=False, timer=timer) as prof:
        with timer("step"):
            with timer("compute"):
                for _ in range(20):
                    a = torch.tanh(a @ a)
            with timer("wait"):
                time.sleep(0.05)
    assert timer.annotate is None, "the phases are ranges only while the step is profiled"
    assert sorted(os.listdir(tmp_path)) == ["step3-rank0.json.gz", "step3-rank0.summary.json"]  # nothing half-written
    with open(tmp_path / "step3-rank0.summary.json") as f:
        summary = json.load(f)
    assert summary == prof.summary | {"trace": str(tmp_path / "step3-rank0.json.gz")}
    phases = summary["phases"]
    assert set(phases) == {"step", "compute", "wait"}
    assert phases["wait"]["wall_ms"] >= 50
    assert phases["step"]["wall_ms"] >= phases["compute"]["wall_ms"] + phases["wait"]["wall_ms"]
    assert phases["compute"]["busy_ms"] is None, "no device kernels on CPU"
    assert any("mm" in op["name"] for op in summary["top"]), summary["top"]  # CPU ops stand in for kernels
    with gzip.open(tmp_path / "step3-rank0.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"phase/step", "phase/compute", "phase/wait"} <= names


def test_only_the_chosen_step_and_ranks_are_profiled(tmp_path):
    logging_cfg = ActorJobConfig().logging
    logging_cfg.profile_step, logging_cfg.profile_ranks = 2, [0, 3]
    timer = Timer()
    assert isinstance(profiler_for(logging_cfg, str(tmp_path), 2, 3, False, timer), StepProfiler)
    assert not isinstance(profiler_for(logging_cfg, str(tmp_path), 1, 0, False, timer), StepProfiler)
    assert not isinstance(profiler_for(logging_cfg, str(tmp_path), 2, 1, False, timer), StepProfiler)


@pytest.mark.parametrize(("key", "value"), [("profile_step", -2), ("profile_ranks", [-1])])
def test_bad_profile_keys_name_the_key(key, value):
    cfg = ActorJobConfig()
    setattr(cfg.logging, key, value)
    with pytest.raises(ConfigError, match=f"logging.{key}"):
        cfg.validate()


def test_kernels_are_attributed_to_the_phase_whose_window_holds_them():
    """The GPU path of the summary on hand-made events: busy time is the union over streams, and device-side
    annotations (a phase's own range, c10d's range around a collective) are not counted as kernels."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from aligner.utils.profiling import summarize

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(
            name=name,
            time_range=SimpleNamespace(start=start, end=end),
            device_type=device,
            is_user_annotation=annotation,
            self_cpu_time_total=0,
        )

    events = [
        event("phase/generate", 0, 1000, DeviceType.CPU, annotation=True),
        event("phase/train", 1000, 3000, DeviceType.CPU, annotation=True),
        event("phase/generate", 0, 1000, annotation=True),  # the phase's device-side copy
        event("nvjet_gemm_a", 100, 500),
        event("nvjet_gemm_a", 600, 800),
        event("nccl:all_reduce", 1100, 1600, annotation=True),  # c10d's range around the kernel below
        event("ncclDevKernel_AllReduce_Sum_bf16", 1100, 1600),
        event("nvjet_gemm_b", 1400, 2000),  # overlaps the all-reduce on another stream
    ]
    phases = summarize(events, gpu=True)["phases"]
    assert phases["generate"]["wall_ms"] == 1.0 and phases["generate"]["busy_ms"] == 0.6
    assert phases["train"]["busy_ms"] == 0.9  # 1100..2000, the overlap counted once
    assert phases["train"]["by_kind_ms"] == {"gemm": 0.6, "communication": 0.5}
    assert [k["name"] for k in phases["generate"]["top"]] == ["nvjet_gemm_a"]
    assert phases["generate"]["top"][0]["calls"] == 2
