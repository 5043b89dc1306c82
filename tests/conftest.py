import pytest
import torch

from custom_ops import library_status
from tests.ops_levels import LEVELS


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=LEVELS or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"compiled ops unavailable: {library_status()}"))])
def cpu_level(request, monkeypatch) -> str:
    monkeypatch.setenv("GROUPBERT_CPU_CAPABILITY", request.param)
    assert torch.ops.groupbert.cpu_capability() == request.param, "the level did not take effect"
    return request.param
