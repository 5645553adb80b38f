// binary16 <-> float32 on the GPU through PTX cvt instructions (no CUDA header needed under
// NVRTC), and the loads and stores every kernel here uses. Included by fused_adamw.cu and
// quantize.cu; zerompi/optim/cuda.py pastes it in place of the #include.
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

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(zmp_half x) { return zmp_h2f(x); }
__device__ __forceinline__ void store_as(float *p, float x) { *p = x; }
__device__ __forceinline__ void store_as(zmp_half *p, float x) { *p = zmp_f2h(x); }

#endif
