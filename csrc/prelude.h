// What the kernels use of torch: tensors (ATen's core Tensor and the operators its methods call) and
// at::parallel_for; `torch::` names ATen's, as <torch/types.h> would. Not <ATen/ATen.h> nor
// <torch/extension.h>: each source parses these headers once per build variant, and the whole of ATen
// (or the C++ frontend on top) costs seconds of every compile for nothing the kernels use.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

namespace torch {
using namespace at;
}
