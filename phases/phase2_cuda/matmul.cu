// Phase 2.2: the matmul ladder on CUDA cores (fp32 FMA). C = A @ B, row-major, A: M x K, B: K x N, C: M x N.
// Every kernel is bounds-checked for any M, N, K (out-of-range tile elements load as zero, out-of-
// range outputs are not stored). Dimensions are int (the Python side keeps every matrix < 2^31
// elements). Each launcher returns the cudaError_t of cudaGetLastError() after its launch.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

extern "C" const char* lab_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// ---------------------------------------------------------------------------------------------
// Rung 1, naive: one thread per output. x walks columns, so a warp reads one row of A (a broadcast)
// and 32 consecutive elements of a row of B (coalesced); every operand comes from global memory /
// L2 again for every output, 2K loads per 2K FLOPs.
extern "C" __global__ void matmul_naive(const float* __restrict__ A, const float* __restrict__ B,
                                        float* __restrict__ C, int M, int N, int K) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y * blockDim.y + threadIdx.y;
    if (row >= M || col >= N) return;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += A[(size_t)row * K + k] * B[(size_t)k * N + col];
    C[(size_t)row * N + col] = acc;
}

extern "C" int launch_matmul_naive(const float* A, const float* B, float* C, int M, int N, int K,
                                   cudaStream_t stream) {
    dim3 block(16, 16), grid((N + 15) / 16, (M + 15) / 16);
    matmul_naive<<<grid, block, 0, stream>>>(A, B, C, M, N, K);
    return (int)cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Rung 2, tiled (the seed's): a 16x16 block stages a 16x16 tile of A and of B in shared memory,
// so each global element is loaded once per block instead of once per thread: 16x fewer loads.
// `k_end` is the loop bound over K; the correct launcher passes K. The broken launcher below
// passes K rounded down to the tile, skipping the K tail, so the checker can be shown to fail it.
#define T 16
extern "C" __global__ void matmul_tiled(const float* __restrict__ A, const float* __restrict__ B,
                                        float* __restrict__ C, int M, int N, int K, int k_end) {
    __shared__ float As[T][T];
    __shared__ float Bs[T][T + 1];
    int tx = threadIdx.x, ty = threadIdx.y;
    int row = blockIdx.y * T + ty, col = blockIdx.x * T + tx;
    float acc = 0.f;
    for (int k0 = 0; k0 < k_end; k0 += T) {
        As[ty][tx] = (row < M && k0 + tx < k_end) ? A[(size_t)row * K + k0 + tx] : 0.f;
        Bs[ty][tx] = (k0 + ty < k_end && col < N) ? B[(size_t)(k0 + ty) * N + col] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < T; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row < M && col < N) C[(size_t)row * N + col] = acc;
}

extern "C" int launch_matmul_tiled(const float* A, const float* B, float* C, int M, int N, int K,
                                   cudaStream_t stream) {
    dim3 block(T, T), grid((N + T - 1) / T, (M + T - 1) / T);
    matmul_tiled<<<grid, block, 0, stream>>>(A, B, C, M, N, K, K);
    return (int)cudaGetLastError();
}

// A deliberately wrong launcher (tests only): drops the last K % 16 terms of every dot product.
extern "C" int launch_matmul_tiled_skip_k_tail(const float* A, const float* B, float* C, int M, int N,
                                               int K, cudaStream_t stream) {
    dim3 block(T, T), grid((N + T - 1) / T, (M + T - 1) / T);
    matmul_tiled<<<grid, block, 0, stream>>>(A, B, C, M, N, K, K - K % T);
    return (int)cudaGetLastError();
}
#undef T

// ---------------------------------------------------------------------------------------------
// Rung 3, coalesced_regblock: a 64x64 block tile over BK = 16, 64 threads each computing an 8x8
// sub-tile held in registers. Per k step a thread reads 8 values of A and 8 of B from shared
// memory and does 64 FMAs (4 FMAs per shared load instead of the tiled kernel's 1/2). Global
// loads are float4 along a row (A along K, B along N) when K and N are multiples of 4 and the
// pointers 16-byte aligned (`vec`), else scalar with bounds checks. A is stored transposed in
// shared memory (As[k][m]) so that both operands are read as contiguous float4s.
#define RB_BM 64
#define RB_BN 64
#define RB_BK 16
#define RB_TM 8
#define RB_TN 8
extern "C" __global__ void __launch_bounds__(64)
matmul_regblock(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                int M, int N, int K, int vec) {
    __shared__ __align__(16) float As[RB_BK][RB_BM];
    __shared__ __align__(16) float Bs[RB_BK][RB_BN];
    const int tid = threadIdx.x;
    const int tr = tid / 8, tc = tid % 8;                    // this thread's 8x8 sub-tile
    const int m0 = blockIdx.y * RB_BM, n0 = blockIdx.x * RB_BN;
    float acc[RB_TM][RB_TN] = {};
    float a[RB_TM], b[RB_TN];

    for (int k0 = 0; k0 < K; k0 += RB_BK) {
        // A tile: 64 rows x 16 k = 256 float4 slots, 4 per thread.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int slot = tid + i * 64;
            int r = slot / 4, kk = (slot % 4) * 4;
            int gm = m0 + r, gk = k0 + kk;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (vec) {
                if (gm < M && gk < K) v = *reinterpret_cast<const float4*>(A + (size_t)gm * K + gk);
            } else if (gm < M) {
                const float* p = A + (size_t)gm * K;
                if (gk < K) v.x = p[gk];
                if (gk + 1 < K) v.y = p[gk + 1];
                if (gk + 2 < K) v.z = p[gk + 2];
                if (gk + 3 < K) v.w = p[gk + 3];
            }
            As[kk][r] = v.x; As[kk + 1][r] = v.y; As[kk + 2][r] = v.z; As[kk + 3][r] = v.w;
        }
        // B tile: 16 k x 64 columns = 256 float4 slots, 4 per thread.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int slot = tid + i * 64;
            int kk = slot / 16, c = (slot % 16) * 4;
            int gk = k0 + kk, gn = n0 + c;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (vec) {
                if (gk < K && gn < N) v = *reinterpret_cast<const float4*>(B + (size_t)gk * N + gn);
            } else if (gk < K) {
                const float* p = B + (size_t)gk * N;
                if (gn < N) v.x = p[gn];
                if (gn + 1 < N) v.y = p[gn + 1];
                if (gn + 2 < N) v.z = p[gn + 2];
                if (gn + 3 < N) v.w = p[gn + 3];
            }
            *reinterpret_cast<float4*>(&Bs[kk][c]) = v;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < RB_BK; ++k) {
            float4 a0 = *reinterpret_cast<const float4*>(&As[k][tr * RB_TM]);
            float4 a1 = *reinterpret_cast<const float4*>(&As[k][tr * RB_TM + 4]);
            float4 b0 = *reinterpret_cast<const float4*>(&Bs[k][tc * RB_TN]);
            float4 b1 = *reinterpret_cast<const float4*>(&Bs[k][tc * RB_TN + 4]);
            a[0] = a0.x; a[1] = a0.y; a[2] = a0.z; a[3] = a0.w; a[4] = a1.x; a[5] = a1.y; a[6] = a1.z; a[7] = a1.w;
            b[0] = b0.x; b[1] = b0.y; b[2] = b0.z; b[3] = b0.w; b[4] = b1.x; b[5] = b1.y; b[6] = b1.z; b[7] = b1.w;
#pragma unroll
            for (int i = 0; i < RB_TM; ++i)
#pragma unroll
                for (int j = 0; j < RB_TN; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < RB_TM; ++i) {
        int gm = m0 + tr * RB_TM + i;
        if (gm >= M) break;
        float* crow = C + (size_t)gm * N;
#pragma unroll
        for (int j = 0; j < RB_TN; j += 4) {
            int gn = n0 + tc * RB_TN + j;
            if (vec && gn + 3 < N) {
                *reinterpret_cast<float4*>(crow + gn) = make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) if (gn + q < N) crow[gn + q] = acc[i][j + q];
            }
        }
    }
}

extern "C" int launch_matmul_regblock(const float* A, const float* B, float* C, int M, int N, int K,
                                      cudaStream_t stream) {
    int vec = (K % 4 == 0) && (N % 4 == 0) && ((uintptr_t)A % 16 == 0) && ((uintptr_t)B % 16 == 0)
              && ((uintptr_t)C % 16 == 0);
    dim3 grid((N + RB_BN - 1) / RB_BN, (M + RB_BM - 1) / RB_BM);
    matmul_regblock<<<grid, 64, 0, stream>>>(A, B, C, M, N, K, vec);
    return (int)cudaGetLastError();
}
