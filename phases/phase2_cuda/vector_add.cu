// Phase 2.1: vector add, c = a + b over fp32 vectors. One thread per element.
// The seed's launch: 1M elements as 4096 blocks x 256 threads; any n works, the guard
// `i < n` keeps the last block inside the arrays when n is not a multiple of 256.
#include <cuda_runtime.h>

extern "C" const char* lab_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

extern "C" __global__ void vector_add(const float* __restrict__ a, const float* __restrict__ b,
                                      float* __restrict__ c, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // 64-bit: 2^31 elements and beyond
    if (i < n) c[i] = a[i] + b[i];                                      // the tail guard
}

extern "C" int launch_vector_add(const float* a, const float* b, float* c, long long n,
                                 int threads, cudaStream_t stream) {
    if (n <= 0) return 0;
    long long blocks = (n + threads - 1) / threads;
    vector_add<<<(unsigned)blocks, threads, 0, stream>>>(a, b, c, n);
    return (int)cudaGetLastError();
}
