// Phase 2.2, tensor-core rungs through the warp-level mma.sync instruction (sm_80 and later).
// C = A @ B, row-major, A: M x K bf16, B: K x N bf16, fp32 accumulation. Bounds-checked for any
// M, N, K. Each launcher returns the cudaError_t of cudaGetLastError() after its launch.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>

extern "C" const char* lab_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

// ---------------------------------------------------------------------------------------------
// Rung 4, mma_bf16: tensor cores through one warp-level instruction,
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (inline PTX): a 16x16 bf16 tile of A times
// a 16x8 bf16 tile of B, accumulated in fp32. A 64x64 block tile over BK = 32, 4 warps in a 2x2
// grid, each warp a 32x32 tile = 2 (m16) x 4 (n8) accumulators of 4 floats per thread.
// Fragments are read from shared memory by hand (no ldmatrix): A as As[m][k], B transposed as
// Bs[n][k], so each 32-bit fragment register is two consecutive k values. Row pitch 40 bf16
// (20 words) keeps the 8 rows x 4 words a warp reads on 32 distinct banks.
#define MM_BM 64
#define MM_BN 64
#define MM_BK 32
#define MM_PITCH (MM_BK + 8)

__device__ __forceinline__ void mma_m16n8k16_bf16(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

extern "C" __global__ void __launch_bounds__(128)
matmul_mma_bf16(const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B,
                float* __restrict__ C, int M, int N, int K, int vec) {
    __shared__ __align__(16) __nv_bfloat16 As[MM_BM][MM_PITCH];
    __shared__ __align__(16) __nv_bfloat16 Bs[MM_BN][MM_PITCH];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // this warp's 32x32 tile in the block tile
    const int g = lane / 4, t = lane % 4;                  // groupID, thread-in-group (PTX fragment layout)
    const int m0 = blockIdx.y * MM_BM, n0 = blockIdx.x * MM_BN;
    const __nv_bfloat16 zero = __float2bfloat16(0.f);
    float acc[2][4][4] = {};

    for (int k0 = 0; k0 < K; k0 += MM_BK) {
        // A tile 64 x 32 = 256 chunks of 8 bf16 (16 bytes), 2 per thread.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int slot = tid + i * 128;
            int r = slot / 4, kk = (slot % 4) * 8;
            int gm = m0 + r, gk = k0 + kk;
            if (vec) {
                uint4 v = make_uint4(0, 0, 0, 0);
                if (gm < M && gk < K) v = *reinterpret_cast<const uint4*>(A + (size_t)gm * K + gk);
                *reinterpret_cast<uint4*>(&As[r][kk]) = v;
            } else {
#pragma unroll
                for (int q = 0; q < 8; ++q)
                    As[r][kk + q] = (gm < M && gk + q < K) ? A[(size_t)gm * K + gk + q] : zero;
            }
        }
        // B tile 32 k x 64 n = 256 chunks of 8 bf16 along n, 2 per thread, stored transposed.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int slot = tid + i * 128;
            int kk = slot / 8, c = (slot % 8) * 8;
            int gk = k0 + kk, gn = n0 + c;
            __nv_bfloat16 v[8];
            if (vec) {
                uint4 u = make_uint4(0, 0, 0, 0);
                if (gk < K && gn < N) u = *reinterpret_cast<const uint4*>(B + (size_t)gk * N + gn);
                const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&u);
#pragma unroll
                for (int q = 0; q < 8; ++q) v[q] = h[q];
            } else {
#pragma unroll
                for (int q = 0; q < 8; ++q) v[q] = (gk < K && gn + q < N) ? B[(size_t)gk * N + gn + q] : zero;
            }
#pragma unroll
            for (int q = 0; q < 8; ++q) Bs[c + q][kk] = v[q];
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < MM_BK; ks += 16) {
            uint32_t af[2][4], bfr[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                int r = wm + mi * 16 + g;
                af[mi][0] = *reinterpret_cast<const uint32_t*>(&As[r][ks + 2 * t]);
                af[mi][1] = *reinterpret_cast<const uint32_t*>(&As[r + 8][ks + 2 * t]);
                af[mi][2] = *reinterpret_cast<const uint32_t*>(&As[r][ks + 2 * t + 8]);
                af[mi][3] = *reinterpret_cast<const uint32_t*>(&As[r + 8][ks + 2 * t + 8]);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                int c = wn + ni * 8 + g;
                bfr[ni][0] = *reinterpret_cast<const uint32_t*>(&Bs[c][ks + 2 * t]);
                bfr[ni][1] = *reinterpret_cast<const uint32_t*>(&Bs[c][ks + 2 * t + 8]);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma_m16n8k16_bf16(acc[mi][ni], af[mi], bfr[ni]);
        }
        __syncthreads();
    }
    // Accumulator layout: c0,c1 at (g, 2t..2t+1), c2,c3 at (g+8, 2t..2t+1) of each 16x8 tile.
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int gm = m0 + wm + mi * 16 + g + h * 8;
                int gn = n0 + wn + ni * 8 + 2 * t;
                if (gm < M) {
                    if (gn < N) C[(size_t)gm * N + gn] = acc[mi][ni][2 * h];
                    if (gn + 1 < N) C[(size_t)gm * N + gn + 1] = acc[mi][ni][2 * h + 1];
                }
            }
}

extern "C" int launch_matmul_mma_bf16(const __nv_bfloat16* A, const __nv_bfloat16* B, float* C,
                                      int M, int N, int K, cudaStream_t stream) {
    int vec = (K % 8 == 0) && (N % 8 == 0) && ((uintptr_t)A % 16 == 0) && ((uintptr_t)B % 16 == 0);
    dim3 grid((N + MM_BN - 1) / MM_BN, (M + MM_BM - 1) / MM_BM);
    matmul_mma_bf16<<<grid, 128, 0, stream>>>(A, B, C, M, N, K, vec);
    return (int)cudaGetLastError();
}
