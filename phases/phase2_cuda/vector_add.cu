// Phase 2.1: vector add, c = a + b over fp32 vectors. One thread per element.
// The seed's launch: 1M elements as 4096 blocks x 256 threads; any n works, the guard
// `i < n` keeps the last block inside the arrays when n is not a multiple of 256.
#include <cuda_runtime.h>
#include <stdint.h>

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

// The same sum with 16-byte accesses: each thread loads one float4 of a and of b and stores one
// float4 of c. A warp then moves 3 x 512 bytes per instruction triple instead of 3 x 128, so the
// SM issues a quarter of the load/store instructions for the same bytes, and more bytes are in
// flight per thread: what it takes to keep HBM3e busy (Little's law: ~4.8 TB/s x ~1 us latency
// is ~5 MB in flight across 132 SMs, ~36 KB per SM). Needs 16-byte aligned pointers (the
// launcher checks and returns cudaErrorMisalignedAddress otherwise); the n % 4 tail elements are
// added by the first threads of the grid, one scalar each.
extern "C" __global__ void vector_add_vec4(const float* __restrict__ a, const float* __restrict__ b,
                                           float* __restrict__ c, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long n4 = n / 4;
    if (i < n4) {
        float4 x = reinterpret_cast<const float4*>(a)[i];
        float4 y = reinterpret_cast<const float4*>(b)[i];
        reinterpret_cast<float4*>(c)[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    long long tail = n4 * 4 + i;                                         // at most 3 such threads
    if (i < n % 4) c[tail] = a[tail] + b[tail];
}

extern "C" int launch_vector_add_vec4(const float* a, const float* b, float* c, long long n,
                                      int threads, cudaStream_t stream) {
    if (n <= 0) return 0;
    if (((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16) return (int)cudaErrorMisalignedAddress;
    long long work = n / 4 > n % 4 ? n / 4 : n % 4;                    // threads needed
    long long blocks = (work + threads - 1) / threads;
    vector_add_vec4<<<(unsigned)blocks, threads, 0, stream>>>(a, b, c, n);
    return (int)cudaGetLastError();
}
