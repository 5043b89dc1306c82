"""Compiled custom ops of the project: the grouped 1-D convolution and the fused LAMB step.

The ONNX graphs name custom nodes in one domain, `DOMAIN`; the session lowers them
to `torch.ops.groupbert.*` when the compiled library is built (`make`) and to the
pure-torch versions in this package, with a one-line warning, when it is not.
The CPU kernels pick the best variant this CPU runs (generic, avx2, avx512, plus AMX
tiles for bf16); `cpu_capability()` says which, GROUPBERT_CPU_CAPABILITY lowers it.
"""
from custom_ops._library import (
    DOMAIN,
    DOMAIN_VERSION,
    GROUPED_CONV1D,
    cpu_capability,
    library_status,
    load_library,
    supported_cpu_capabilities,
)
from custom_ops.grouped_conv1d import grouped_conv1d
from custom_ops.lamb import lamb_sq_norms, lamb_stage1, lamb_stage2

__all__ = ["DOMAIN", "DOMAIN_VERSION", "GROUPED_CONV1D", "library_status", "load_library",
           "cpu_capability", "supported_cpu_capabilities",
           "grouped_conv1d",
           "lamb_sq_norms", "lamb_stage1", "lamb_stage2"]
