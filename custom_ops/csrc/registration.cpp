// Declares the `groupbert` operator library. Each op file adds its schema with
// TORCH_LIBRARY_FRAGMENT and its kernels with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

TORCH_LIBRARY(groupbert, m) {}
