"""checks/gpu_paths.py, the GPU check's list of CUDA-only paths: on a machine without a GPU each
check says so in one line; the checks whose kernels have CPU twins run here, so a wrong call in them
fails on CPU, not in the minutes a GPU is lent."""

import json
import os
import subprocess
import sys

import pytest
import torch

from checks import gpu_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the paths issue 35 lists as run only on CUDA, each a check of its own
EXPECTED = {"nccl", "flash_attn_vs_sdpa", "precision", "fp16_loss_scale_stop", "ring_flash_vs_full",
            "grouped_gemm_bf16", "async_save", "pinned_batches", "compile_vs_eager", "fp8_gemm",
            "activation_offload", "moe_host_syncs", "tp_overlap_nccl", "ulysses_all_to_all_nccl",
            "moe_all_to_all_nccl", "gated_delta_net_fla"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run of this script is the GPU check itself")
def test_without_a_gpu_every_check_is_one_skip_line(tmp_path):
    out = tmp_path / "paths.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "checks", "gpu_paths.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["check"] for r in lines} == EXPECTED and len(lines) == len(EXPECTED)
    assert all(r["ok"] is None and "GPU" in r["skipped"] for r in lines)
    assert proc.stdout.strip().splitlines() == [json.dumps(r) for r in lines]
    assert "checks/gpu_paths.py" in open(os.path.join(ROOT, "benchmarks", "gpu_check.sh")).read()


@pytest.mark.slow  # 30 s on 2 cores: the full suite
def test_checks_with_cpu_twins_pass_on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_paths, "DEVICE", torch.device("cpu"))
    for check in (gpu_paths.precision, gpu_paths.grouped_gemm_bf16, gpu_paths.moe_host_syncs):
        result = check()
        assert result["ok"] is True, (check.__name__, result)
    pytest.importorskip("torchao.float8")
    assert gpu_paths.fp8_gemm()["ok"] is True


def test_ring_check_merges_the_cpu_kernel_to_full_attention(monkeypatch):
    """The ring check's block loop with the CPU kernel in the CUDA one's place: it fails only on the
    kernel's name, its figures within the check's bound."""
    monkeypatch.setattr(gpu_paths, "DEVICE", torch.device("cpu"))
    result = gpu_paths.ring_flash_vs_full()
    assert result["kernel"] != "flash" and result["ok"] is False
    assert all(result[k] < 3e-2 for k in ("output", "grad_q", "grad_k", "grad_v")), result
