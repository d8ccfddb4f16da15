"""benchmarks/gpu_step.py, the GPU step benchmark of issue 65, checked on the CPU: the same
script with small models (``--device cpu --tiny``) under a real torchrun of 2 processes over
Gloo, every method timed in every round, our hooks on a data plane of their own."""

import json
from pathlib import Path

import pytest

from launch import succeeded, torchrun

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_step.py"


@pytest.mark.torchrun
def test_the_gpu_step_benchmark_runs_every_method_and_reports_each_pair(tmp_path):
    out = succeeded(torchrun([str(SCRIPT), "--device", "cpu", "--tiny", "--rounds", "2",
                              "--batch", "resnet50=4,gpt2-small=2", "--out", str(tmp_path)], np=2, timeout=400))
    runs = json.loads((tmp_path / "gpu-step.json").read_text())
    methods = ("none", "fp16", "powersgd-r4", "ours-default", "ours-quantize8s", "ours-r4")
    for model in ("resnet50", "gpt2-small"):
        for method in methods:
            mine = [r for r in runs if r["model"] == model and r["method"] == method]
            assert sorted(r["round"] for r in mine) == [0, 1], (model, method, out)
            assert all(r["step_s"] > 0 for r in mine)
            if method.startswith("ours-"):
                assert all(r["data_plane"] == "ProcessGroupChannel (gloo), 2 rank(s)" for r in mine), mine
        default = [r for r in runs if r["model"] == model and r["method"] == "ours-default"]
        assert all(len(r["steps_s"]) == 14 + 200 for r in default)  # past the gate's two windows of 100 steps
        assert all(r["gate"] in ("compress", "dense16") for r in default), default  # the gate decided
    report = (tmp_path / "gpu-step.md").read_text()
    for pair in ("ours-default / fp16", "ours-quantize8s / fp16", "ours-r4 / powersgd-r4"):
        assert report.count(f"| {pair} |") == 2, report  # one row per model
