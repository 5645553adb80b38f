// binary16 <-> float32 on the GPU through PTX cvt instructions, bfloat16 <-> float32 by integer
// operations (no CUDA header needed under NVRTC), and the loads and stores every kernel here
// uses. Included by fused_adamw.cu and quantize.cu; zerompi/optim/cuda.py pastes it in place
// of the #include.
//
// bfloat16 is a struct around its 16 bits, so that overloads tell it from binary16. float ->
// bfloat16 rounds to nearest even and turns NaN into the quiet NaN 0x7fc0 with its sign, as
// the C kernels (bf16_cpu.h) and ml_dtypes (the NumPy reference) do.
#ifndef ZMP_CUDA_HALF_H
#define ZMP_CUDA_HALF_H

typedef unsigned short zmp_half;

__device__ __forceinline__ float zmp_h2f(zmp_half h)
{
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ zmp_half zmp_f2h(float f)
{
    zmp_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));   // round to nearest even
    return h;
}

struct zmp_bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float zmp_b2f(zmp_bf16 h) { return __uint_as_float((unsigned int)h.bits << 16); }

__device__ __forceinline__ zmp_bf16 zmp_f2b(float f)
{
    unsigned int u = __float_as_uint(f);
    zmp_bf16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
        return h;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    h.bits = (unsigned short)(u >> 16);
    return h;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(zmp_half x) { return zmp_h2f(x); }
__device__ __forceinline__ float to_float(zmp_bf16 x) { return zmp_b2f(x); }
__device__ __forceinline__ void store_as(float *p, float x) { *p = x; }
__device__ __forceinline__ void store_as(zmp_half *p, float x) { *p = zmp_f2h(x); }
__device__ __forceinline__ void store_as(zmp_bf16 *p, float x) { *p = zmp_f2b(x); }

#endif
