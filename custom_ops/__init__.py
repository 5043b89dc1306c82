"""Compiled custom ops of the project: the grouped 1-D convolution and the fused LAMB step.

The ONNX graphs name custom nodes in one domain, `DOMAIN`; the session lowers them
to `torch.ops.groupbert.*` when the compiled library is built (`make`) and to the
pure-torch versions, with a one-line warning, when it is not. Each op's typed
wrapper lives in its own module (`custom_ops.grouped_conv1d.grouped_conv1d`,
`custom_ops.lamb.lamb_stage1`, ...); this package holds only what needs no torch (the
domain's names, the kernels' limits, the library's status), so the builder and the
config import it for free. The CPU kernels pick the best variant this CPU runs
(generic, avx2, avx512, avx512_bf16, plus AMX tiles for bf16); `cpu_capability()` says
which, GROUPBERT_CPU_CAPABILITY lowers it.
"""
from custom_ops._library import (
    DOMAIN,
    DOMAIN_VERSION,
    GROUPED_CONV1D,
    MAX_CHANNELS_PER_GROUP,
    cpu_capability,
    library_status,
    load_library,
    supported_cpu_capabilities,
)

__all__ = ["DOMAIN", "DOMAIN_VERSION", "GROUPED_CONV1D", "MAX_CHANNELS_PER_GROUP", "cpu_capability",
           "library_status", "load_library", "supported_cpu_capabilities"]
