// The float storage types the kernels take (float, c10::BFloat16, c10::Half), shared by cpu_ops.cpp and moe_ops.cpp:
//   dispatch_float  calls f with a value of the type a float tensor holds, so one template body serves the three
//                   dtypes; any other dtype is a TORCH_CHECK error naming `what`
//   load16          (AVX-512) 16 values widened to float32 lanes: bf16 by a 16-bit shift, f16 by vcvtph2ps
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

}  // namespace tandem_kernels
