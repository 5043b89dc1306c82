"""The peaks the training log's MFU is measured against (session/peaks.py): NVIDIA's dense
datasheet figures by the name torch reports, and on the CPU a GEMM measured once per process."""
import pytest

from session.peaks import Peak, datasheet_peak, device_peak, flops_text, measured_gemm_peak


@pytest.mark.parametrize("name, precision, flops", [
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA H100 PCIe", "fp16", 756.0e12),  # fp16 runs at the bf16 rate
    ("NVIDIA H100 PCIe", "fp32", 51.2e12),  # the CUDA cores, not TF32
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0e12),
    ("NVIDIA H100 NVL", "fp32", None),  # not in the table: no figure rather than a guess
    ("Tesla T4", "bf16", None),
])
def test_datasheet_peaks_by_the_name_torch_reports(name, precision, flops):
    peak = datasheet_peak(name, precision)
    assert (peak.flops if peak else None) == flops
    if peak:
        assert "datasheet" in peak.source


def test_the_cpu_peak_is_a_gemm_measured_once_per_process():
    peak = device_peak("cpu", "fp32")
    assert isinstance(peak, Peak) and 1e8 < peak.flops < 1e15, peak
    assert peak.source == "1024³ fp32 GEMM measured at start"
    assert device_peak("cpu", "fp32") is peak, "measured once per process, not per run"
    assert measured_gemm_peak("bf16").source.endswith("bf16 GEMM measured at start")


def test_flops_text():
    assert flops_text(412.3e12) == "412 TFLOP/s" and flops_text(38.46e9) == "38.5 GFLOP/s"
