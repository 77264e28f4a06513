// dispatch_float: calls f with a value of the storage type a float tensor holds (float, c10::BFloat16, c10::Half),
// so one template body serves the three dtypes the kernels take; any other dtype is a TORCH_CHECK error naming `what`.
// Shared by cpu_ops.cpp and moe_ops.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace tandem_kernels {

template <typename F>
void dispatch_float(at::ScalarType t, const char* what, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": dtype ", t, " is not supported (float32, bfloat16, float16)");
  }
}

}  // namespace tandem_kernels
