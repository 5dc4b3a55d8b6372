// Shared by every mpfa kernel library: the C entry-point convention and error reporting.
//
// Each library is one specialization with plain C entry points taking raw pointers, sizes and a
// cudaStream_t, returning a cudaError_t (0 = launched). No Python or torch ABI crosses this line.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

#define MPFA_EXPORT extern "C" __attribute__((visibility("default")))

MPFA_EXPORT const char* mpfa_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

namespace mpfa {

// Selects the device the caller's tensors live on. The library links its own (static) CUDA runtime,
// whose current device is not torch's; the primary context is shared, so this is cheap when equal.
inline cudaError_t set_device(int device) {
  int cur = -1;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) return e;
  return cur == device ? cudaSuccess : cudaSetDevice(device);
}

inline int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device]) return cached[device];
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

template <int N>
struct alignas(N) Bytes { uint8_t b[N]; };

// max(a, b) that returns NaN when either is NaN (max.NaN.f32: one FMNMX.NAN, as fmaxf is one FMNMX). A softmax
// whose scores are all NaN (a NaN query) must not read its row maximum as -inf ("no key") and write zeros; an
// amax built with it is NaN or inf exactly when the group holds a NaN or an infinity.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// min(a, b), NaN when either is NaN (min.NaN.f32): kV4's group minimum, NaN exactly when the group holds one.
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// 2^x in one MUFU.EX2, flushing denormal results to 0 (exp2f adds range fix-ups around it). Softmax
// probabilities below 2^-126 are 0 in the fp16 / FP8 P the kernels multiply anyway, and far below half
// an ulp of a row sum that holds a 1.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace mpfa
