#include <torch/library.h>
