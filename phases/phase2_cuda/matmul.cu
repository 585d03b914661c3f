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
// Rung 2b, regblock_1d (siboehm's kernel 4): 1D register blocking, the one idea between `tiled`
// and `coalesced_regblock`. A 64x64 block tile over BK = 8, 512 threads; each thread computes a
// column of TM = 8 outputs of C in registers instead of one. Per k step a thread loads one B value
// into a register and reuses it for 8 FMAs; the 8 A values As[row0 + i][k] are the same for all 32
// threads of a warp (a broadcast), and being contiguous per thread they are fetched as LDS.128s:
// 8 LDS + 16 LDS.128 feed 64 FMAs, 0.375 load instructions per FMA against the tiled kernel's 2.
// What still limits it is the shared-memory pipe (one 128-byte wavefront per clock per SM against
// 4 warp-FFMAs issued): per warp per tile about 40 wavefronts for 64 FFMAs. Global/L2 traffic: a
// 64x64 tile reads (64 + 64) x 8 x 4 B = 4 KB per 32K FMAs, 1/8 B per FMA (tiled: 1/2 B).
// Any M, N, K: out-of-range tile elements load as zero, out-of-range outputs are not stored.
// The grid is 1-D (block b -> tile row b / nb, tile column b % nb), so no grid dimension limits M,
// and bounds are tested as `offset < M - m0` (never `m0 + offset < M`, which could overflow int).
__host__ __device__ __forceinline__ int cdiv(int x, int d) { return x / d + (x % d != 0); }   // x >= 0

#define R1_BM 64
#define R1_BN 64
#define R1_BK 8
#define R1_TM 8
#define R1_THREADS (R1_BM * R1_BN / R1_TM)       // 512
extern "C" __global__ void __launch_bounds__(R1_THREADS)
matmul_regblock_1d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                   int M, int N, int K) {
    __shared__ __align__(16) float As[R1_BM][R1_BK];   // A's tile as in global memory (row-major)
    __shared__ __align__(16) float Bs[R1_BK][R1_BN];
    const int tid = threadIdx.x;
    const int nb = cdiv(N, R1_BN);
    const int m0 = (blockIdx.x / nb) * R1_BM, n0 = (blockIdx.x % nb) * R1_BN;
    const int col = tid % R1_BN, row0 = (tid / R1_BN) * R1_TM;   // this thread's outputs
    const int a_r = tid / R1_BK, a_c = tid % R1_BK;             // the A element it stages
    const int b_r = tid / R1_BN, b_c = tid % R1_BN;             // the B element it stages
    float acc[R1_TM] = {};

    const int tiles = cdiv(K, R1_BK);
    for (int t = 0; t < tiles; ++t) {
        const int k0 = t * R1_BK;
        As[a_r][a_c] = (a_r < M - m0 && a_c < K - k0) ? A[(size_t)(m0 + a_r) * K + k0 + a_c] : 0.f;
        Bs[b_r][b_c] = (b_r < K - k0 && b_c < N - n0) ? B[(size_t)(k0 + b_r) * N + n0 + b_c] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < R1_BK; ++k) {
            const float b = Bs[k][col];                 // one load, reused for TM FMAs
#pragma unroll
            for (int i = 0; i < R1_TM; ++i) acc[i] += As[row0 + i][k] * b;
        }
        __syncthreads();
    }
    if (col >= N - n0) return;
#pragma unroll
    for (int i = 0; i < R1_TM; ++i)
        if (row0 + i < M - m0) C[(size_t)(m0 + row0 + i) * N + n0 + col] = acc[i];
}

extern "C" int launch_matmul_regblock_1d(const float* A, const float* B, float* C, int M, int N, int K,
                                         cudaStream_t stream) {
    const unsigned blocks = (unsigned)cdiv(N, R1_BN) * (unsigned)cdiv(M, R1_BM);
    matmul_regblock_1d<<<blocks, R1_THREADS, 0, stream>>>(A, B, C, M, N, K);
    return (int)cudaGetLastError();
}

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

// ---------------------------------------------------------------------------------------------
// Rung 4, warptiled_1stage: the CUDA-core kernel that closes the gap to cuBLAS (rung 5, warptiled,
// below, keeps its block tile, warp layout and shared-memory layout). The per-thread work is
// coalesced_regblock's (an 8x8 register tile, 4 float4 shared loads feeding 64 FMAs per k step);
// what changes is everything around it.
//
// * Block tile 128x128 over BK = 8, 256 threads (8 warps), __launch_bounds__(256, 2): registers
//   capped at 65536 / (2 x 256) = 128 so that two blocks (16 warps) share an SM. Global/L2 traffic
//   per FMA halves against 64x64 tiles: (128 + 128) x 8 x 4 B = 8 KB per 128 x 128 x 8 = 128K FMAs,
//   1/16 B per FMA. At N = 4096 the grid is 32 x 32 = 1024 blocks, 3.9 waves of 2 x 132.
// * Warp tiling: each warp owns a 32 (m) x 64 (n) sub-tile, its 32 lanes a 4 x 8 grid of threads,
//   each thread 8x8 outputs as 2 x 2 blocks of 4x4 (warp-tile rows ty*4 and 16 + ty*4, columns tx*4
//   and 32 + tx*4). A warp's A fragment load is then 4 distinct float4s (64 contiguous bytes) and
//   its B load 8 (128 contiguous bytes): no bank conflicts, every other lane a broadcast. The lanes
//   are interleaved (ty = lane bits 4 and 0, tx = lane bits 3..1) so that lanes L and L^2 read the
//   same A float4 and lanes L and L^1 the same B float4: the pattern for which the shared-memory
//   pipe returns an LDS.128 in 2 wavefronts instead of 4 (it returns 128 B per clock, one register
//   per lane; a uniform pair lets it pack two; NVIDIA developer forum, the reason for CUTLASS's
//   "RowMajorInterleaved<2>" SIMT lane layout). That is the budget that decides this kernel: an SM
//   issues 4 warp-FFMAs and serves 1 shared wavefront per clock, and one warp k step is 64 FFMAs
//   (16 SM-clocks) and 4 LDS.128: at 4 wavefronts each the shared pipe would be as busy as the
//   FMA units; at 2, half as busy. (coalesced_regblock is past that line: its A loads pair up, 2
//   wavefronts each, but its B loads neither pair up nor avoid a 2-way bank conflict, 8 each:
//   20 wavefronts per 16 clocks of FFMAs.)
// * A stored transposed (As[k][m]) so that an A fragment is a float4 along m. The transposing
//   scalar stores are conflict-free because the rows are padded to 128 + 4 floats: a warp writes
//   16 rows m at two k (0 and 4), and 4 x 132 = 16 mod 32, so the two k land in disjoint halves of
//   the 32 banks (unpadded, 4 x 128 = 0 mod 32: 2-way conflicts); 132 x 4 B keeps every row
//   16-byte aligned for the LDS.128s. B is stored as it is in global memory. One stage is
//   BK x (132 + 128) x 4 B = 8,320 B.
// * float4 global loads (when K and N are multiples of 4 and A, B, C 16-byte aligned; else the
//   `_scalar` kernels, the same code with bounds-checked scalar loads): per tile each thread loads
//   one float4 of A (row tid/2, k (tid%2)*4: a warp reads 16 rows x 32 B, whole sectors) and one
//   of B (k row tid/32: a warp reads 512 contiguous bytes of one row).
// * One shared stage (8,320 B) per block: load a tile into registers, store it, __syncthreads,
//   compute, __syncthreads. A warp's global latency is hidden only behind other warps' FFMAs (two
//   blocks, 16 warps per SM); warptiled (below) streams tiles in ahead of use with cp.async.
//
// The main loop, per thread per tile: 512 FFMA, 32 LDS.128, 2 LDG.128, 4 STS + 1 STS.128, 2
// barriers and the address and loop arithmetic. The shared/L1 pipe per warp per tile: 64
// wavefronts for the fragments, 8 for the stores, 8 to 20 for the global loads' data (A touches
// 16 lines of 32 B, B 4 of 128 B), against 128 SM-clocks of FFMA issue: about two thirds busy.
// Registers: 64 accumulators + 16 fragment values + 8 staged + pointers and bounds (<= 128).
#define WT_BM 128
#define WT_BN 128
#define WT_BK 8
#define WT_AS (WT_BM + 4)                   // As row stride in floats (the padding)
#define WT_THREADS 256
#define WT_LD (WT_BK / 8)                    // float4 loads of A and of B per thread per tile
#define WT_STAGE (WT_BK * (WT_AS + WT_BN))   // floats per shared stage: As (BK x 132), then Bs (BK x 128)

// Global -> registers, one tile. This thread's A elements: row a_r = tid/2 of the block tile, k
// offsets a_k + 8i + {0..3} with a_k = (tid%2)*4; its B elements: k rows b_k + 8i with b_k =
// tid/32, columns b_c + {0..3} with b_c = (tid%32)*4. `pa` / `pb` point at the i = 0 float4 of
// this tile (advanced by the caller); `kl` = K - k0 > 0, the k extent left; `a_ok` says row a_r
// is inside M; `nl` = N - n0 - b_c, the columns left from b_c. Out-of-range elements are zero.
template <bool VEC>
__device__ __forceinline__ void wt_load_tile(const float* pa, const float* pb, int N, int kl, bool a_ok,
                                             int nl, float4 (&ra)[WT_LD], float4 (&rb)[WT_LD]) {
    const int a_k = (threadIdx.x & 1) * 4, b_k = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < WT_LD; ++i) {
        const int ka = a_k + 8 * i, kb = b_k + 8 * i;     // k offsets inside the tile
        const float* a = pa + 8 * i;
        const float* b = pb + (size_t)(8 * i) * N;
        float4 va = make_float4(0.f, 0.f, 0.f, 0.f), vb = va;
        if (VEC) {       // K % 4 == 0 and ka % 4 == 0: ka < kl means all four are in range; N alike
            if (a_ok && ka < kl) va = *reinterpret_cast<const float4*>(a);
            if (kb < kl && nl > 0) vb = *reinterpret_cast<const float4*>(b);
        } else {
            if (a_ok) {
                if (ka + 0 < kl) va.x = a[0];
                if (ka + 1 < kl) va.y = a[1];
                if (ka + 2 < kl) va.z = a[2];
                if (ka + 3 < kl) va.w = a[3];
            }
            if (kb < kl) {
                if (0 < nl) vb.x = b[0];
                if (1 < nl) vb.y = b[1];
                if (2 < nl) vb.z = b[2];
                if (3 < nl) vb.w = b[3];
            }
        }
        ra[i] = va;
        rb[i] = vb;
    }
}

// Registers -> one shared stage: A transposed (4 conflict-free scalar stores per float4), B as is.
__device__ __forceinline__ void wt_store_tile(float* stage, const float4 (&ra)[WT_LD], const float4 (&rb)[WT_LD]) {
    float* As = stage;
    float* Bs = stage + WT_BK * WT_AS;
    const int tid = threadIdx.x;
    const int a_r = tid >> 1, a_k = (tid & 1) * 4;
    const int b_k = tid >> 5, b_c = (tid & 31) * 4;
#pragma unroll
    for (int i = 0; i < WT_LD; ++i) {
        float* at = As + (a_k + 8 * i) * WT_AS + a_r;
        at[0 * WT_AS] = ra[i].x;
        at[1 * WT_AS] = ra[i].y;
        at[2 * WT_AS] = ra[i].z;
        at[3 * WT_AS] = ra[i].w;
        *reinterpret_cast<float4*>(Bs + (b_k + 8 * i) * WT_BN + b_c) = rb[i];
    }
}

// One stage's BK k steps into the 8x8 accumulators; a_off / b_off: this thread's first A row and
// B column inside the block tile.
__device__ __forceinline__ void wt_compute_tile(const float* stage, int a_off, int b_off, float (&acc)[8][8]) {
    const float* As = stage;
    const float* Bs = stage + WT_BK * WT_AS;
#pragma unroll
    for (int k = 0; k < WT_BK; ++k) {
        const float4 a0 = *reinterpret_cast<const float4*>(As + k * WT_AS + a_off);
        const float4 a1 = *reinterpret_cast<const float4*>(As + k * WT_AS + a_off + 16);
        const float4 b0 = *reinterpret_cast<const float4*>(Bs + k * WT_BN + b_off);
        const float4 b1 = *reinterpret_cast<const float4*>(Bs + k * WT_BN + b_off + 32);
        const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
    }
}

// This thread's place in C: the block tile's corner (m0, n0) and, inside it, the first row of its
// A fragment and the first column of its B fragment. Warps 4 (m) x 2 (n), each 32 x 64; lanes 4 x 8,
// interleaved: ty = lane bits 4 and 0, tx = lane bits 3..1 (see above). The thread indices are read
// with asm volatile so the epilogue recomputes this after the main loop instead of keeping it live
// (in registers, or spilled) across it: the loop needs every register it can get.
struct WtPlace { int m0, n0, a_off, b_off; };
__device__ __forceinline__ WtPlace wt_place(int N) {
    unsigned tid, bid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bid));
    const int warp = tid >> 5, lane = tid & 31, nb = cdiv(N, WT_BN);
    const int ty = ((lane >> 4) << 1) | (lane & 1), tx = (lane >> 1) & 7;
    return {(int)(bid / nb) * WT_BM, (int)(bid % nb) * WT_BN, (warp >> 1) * 32 + ty * 4, (warp & 1) * 64 + tx * 4};
}

template <bool VEC>
__device__ __forceinline__ void warptiled_body(const float* __restrict__ A, const float* __restrict__ B,
                                               float* __restrict__ C, int M, int N, int K, float* smem) {
    float acc[8][8] = {};
    {
        const WtPlace p = wt_place(N);
        const int tid = threadIdx.x;
        // This thread's global sources (row a_r clamped into A when out of range: never read then,
        // but a valid address) and bounds, fixed for the whole loop.
        const int a_r = tid >> 1, a_k = (tid & 1) * 4, b_k = tid >> 5, b_c = (tid & 31) * 4;
        const bool a_ok = a_r < M - p.m0;
        const int nl = N - p.n0 - b_c;
        const float* pa = A + (size_t)(a_ok ? p.m0 + a_r : 0) * K + a_k;
        const float* pb = B + (size_t)b_k * N + (nl > 0 ? p.n0 + b_c : 0);
        float4 ra[WT_LD], rb[WT_LD];

        for (int kl = K; kl > 0; kl -= WT_BK) {
            wt_load_tile<VEC>(pa, pb, N, kl, a_ok, nl, ra, rb);
            pa += WT_BK;
            pb += (size_t)WT_BK * N;
            wt_store_tile(smem, ra, rb);
            __syncthreads();
            wt_compute_tile(smem, p.a_off, p.b_off, acc);
            __syncthreads();
        }
    }

    const WtPlace p = wt_place(N);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = p.a_off + (i >> 2) * 16 + (i & 3);        // row inside the block tile
        if (r >= M - p.m0) continue;
        float* crow = C + (size_t)(p.m0 + r) * N + p.n0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = p.b_off + h * 32;                     // column inside the block tile
            const float* v = &acc[i][h * 4];
            if (VEC) {                                          // N % 4 == 0: c < N - n0 covers c + 3
                if (c < N - p.n0) *reinterpret_cast<float4*>(crow + c) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) if (c + q < N - p.n0) crow[c + q] = v[q];
            }
        }
    }
}

#define WT_KERNEL(name, VEC)                                                                           \
    extern "C" __global__ void __launch_bounds__(WT_THREADS, 2)                                        \
    name(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, \
         int K) {                                                                                      \
        __shared__ __align__(16) float smem[WT_STAGE];                                                 \
        warptiled_body<VEC>(A, B, C, M, N, K, smem);                                                    \
    }
WT_KERNEL(matmul_warptiled_1stage, true)
WT_KERNEL(matmul_warptiled_1stage_scalar, false)
#undef WT_KERNEL

static int wt_vec(const float* A, const float* B, const float* C, int N, int K) {
    return (K % 4 == 0) && (N % 4 == 0) && ((uintptr_t)A % 16 == 0) && ((uintptr_t)B % 16 == 0)
           && ((uintptr_t)C % 16 == 0);
}

extern "C" int launch_matmul_warptiled_1stage(const float* A, const float* B, float* C, int M, int N, int K,
                                              cudaStream_t stream) {
    const unsigned blocks = (unsigned)cdiv(N, WT_BN) * (unsigned)cdiv(M, WT_BM);
    if (wt_vec(A, B, C, N, K)) matmul_warptiled_1stage<<<blocks, WT_THREADS, 0, stream>>>(A, B, C, M, N, K);
    else matmul_warptiled_1stage_scalar<<<blocks, WT_THREADS, 0, stream>>>(A, B, C, M, N, K);
    return (int)cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Rung 5, warptiled: warptiled_1stage's block tile (128 x 128), its interleaved 4 x 8 lane grid of
// 4x4 sub-blocks and its A-transposed-in-shared-memory layout (rows of 132 floats, B as stored), so
// the fragment loads stay the conflict-free, pair-broadcast LDS.128s that the shared-memory budget
// above is built on. What changes is how a tile gets from global to shared memory, how the loop
// overlaps copies, barrier and fragment loads with the FFMAs, and how much each thread computes.
//
// * cp.async instead of LDG -> registers -> STS, into a 3-stage ring (3 x 8 x (132 + 128) x 4 B =
//   24,960 B). The copy engine writes shared memory directly, so (1) no staging registers
//   (warptiled_1stage holds 8 between its loads and stores): the ring's depth costs shared memory
//   only; (2) a tile's copies are issued about two tiles before it is computed, with no stores
//   waiting on them in the middle of the loop; (3) fewer instructions: per thread per tile 8
//   LDGSTS.32 (A) + 2 LDGSTS.128 (B) for 1,024 FFMAs, against warptiled_1stage's 2 LDG.128 + 4 STS
//   + 1 STS.128 for 512.
// * A is transposed by the copies themselves: a 4-byte cp.async (the `.ca` form; only 16-byte copies
//   may bypass L1) can write any shared address, so each lands A[m][k] at As[k][m] (CUTLASS's SIMT
//   "align1" kernels do the same). The element map suits both sides: copy j of thread tid moves
//   element e = tid + 128 j of the tile taken as runs of 8 k: row e / 8 of the 128, k e % 8 (8
//   copies per thread: rows tid / 8 + 16 j, k tid % 8). A warp then reads 4 rows x 8 consecutive k
//   (4 whole 32-byte sectors) and writes banks (4 k + row) % 32 of the 132-float rows: 32 distinct
//   banks, no conflict. B is copied as stored, 16 bytes per copy (`.cg`, L2 only; a warp reads 512
//   contiguous bytes of a row) when N % 4 == 0 and B and C are 16-byte aligned (`VEC`; A's
//   alignment and K no longer matter), else 4 bytes per copy.
// * An 8x16 thread tile: 128 threads, 4 warps of 32 x 128, each thread 2 x 4 blocks of 4x4 (rows
//   ty*4 and 16 + ty*4, columns tx*4 + 32h, h = 0..3). Per k step a warp issues 6 LDS.128 (2 of A,
//   4 of B: 12 shared wavefronts) for 128 FFMAs instead of 4 (8 wavefronts) for 64: 0.047 shared
//   loads per FFMA instead of 0.0625, 25% fewer, and the shared pipe 3/8 busy instead of 1/2. The
//   price: 128 accumulators, so 2 blocks = 8 warps per SM (__launch_bounds__(128, 2)), 2 per
//   scheduler; each warp has 128 independent FFMAs per k step, so latency is covered by ILP more
//   than by warps.
// * Offsets into A and B are 32-bit unsigned (the Python side keeps each matrix under 2^31
//   elements), one register each instead of a 64-bit pointer; the block corner and the thread's
//   place are re-read (asm volatile) where needed instead of held across the loop.
// * Bounds: a block whose tile lies inside M x N (all but the last block row and column) issues its
//   whole k tiles with no test at all; its last 3 (+ 1 if K % 8 != 0) iterations, and every
//   iteration of an edge block, take the checked copies, where an out-of-range element is a copy
//   with src-size 0 (zeros written, nothing read) from a valid address (A or B itself). The choice
//   is uniform per block.
// * The loop (CUTLASS's multistage mainloop), one __syncthreads per tile, placed before the last k
//   step: the ring holds tiles t .. t + 2 while tile t is computed. The fragments of k step s + 1
//   are loaded before the FFMAs of step s. Before the last step's FFMAs (its fragments already in
//   registers, so every read of stage t issued): cp.async.wait_group 1 (this thread's copies of
//   tile t + 1 have landed), __syncthreads (everyone's have, and everyone has read stage t), refill
//   stage t with tile t + 3, commit, load tile t + 1's first fragments, then the last step's 128
//   FFMAs, which hide that load's latency across the barrier (warptiled_1stage issues each tile's
//   first LDS.128 only after its barrier, and waits for it). A group is committed every tile,
//   empty past the end, so the wait count stays right.
//
// Registers: 128 accumulators + 2 x (8 + 16) fragment values (step k's and step k + 1's) + offsets
// and ring state, under the 255 that 2 blocks of 128 threads allow (2 x 128 x 255 <= 65,536).
#define WTC_BM 128
#define WTC_BN 128
#define WTC_AS (WTC_BM + 4)                    // As row stride in floats, as in warptiled_1stage

__device__ __forceinline__ uint32_t wtc_smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 4 / 16 bytes global -> shared; the `_n` forms take src_bytes (0: write zeros, read nothing).
__device__ __forceinline__ void wtc_cp4(uint32_t dst, const float* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void wtc_cp4_n(uint32_t dst, const float* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void wtc_cp16(uint32_t dst, const float* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void wtc_cp16_n(uint32_t dst, const float* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void wtc_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wtc_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// This thread's copy sources and destinations, fixed for the whole loop (see the element map above).
// A: copy j reads row a_r + (RP j) % 128, k a_k + 8 (RP j / 128) of the tile, RP = THREADS / 8.
// B: copy i reads k row b_k + (THREADS / 32) i, columns b_c .. b_c + 3.
struct WtcCopy {
    unsigned oa;         // offset of A[m0 + a_r][k0 + a_k] in A, advanced by BK per tile (used only in range)
    unsigned ob;         // offset of B[k0 + b_k][n0 + b_c] in B, advanced by BK rows per tile
    uint32_t a_dst;      // shared byte address of As[a_k][a_r] in stage 0
    uint32_t b_dst;      // shared byte address of Bs[b_k][b_c] in stage 0
};

// The block tile's corner, read with asm volatile so that it is recomputed where needed (the
// checked copies, the epilogue) instead of held in registers across the loop.
__device__ __forceinline__ void wtc_corner(int N, int& m0, int& n0) {
    unsigned bid;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bid));
    const int nb = cdiv(N, WTC_BN);
    m0 = (int)(bid / nb) * WTC_BM;
    n0 = (int)(bid % nb) * WTC_BN;
}

// Issue one tile's copies into the stage at byte offset `ws`; kl = K - k0 > 0, the k extent left.
// CHECK = false: the tile is inside A and B (interior block, full k tile), no tests at all.
template <int THREADS, int BK, bool VEC, bool CHECK>
__device__ __forceinline__ void wtc_issue(const WtcCopy& c, const float* A, const float* B, int M, int N, int K,
                                          int kl, uint32_t ws) {
    constexpr int RP = THREADS / 8, A_COPIES = WTC_BM * BK / THREADS;
    constexpr int KP = THREADS / 32, B_COPIES = BK / KP;
    const int a_k = threadIdx.x & 7, b_k = threadIdx.x >> 5;
    int a_rows = 0, nl = 0;     // rows left from this thread's first A row; columns left from its B column
    if (CHECK) {
        int m0, n0;
        wtc_corner(N, m0, n0);
        a_rows = M - m0 - (int)(threadIdx.x >> 3);
        nl = N - n0 - (int)(threadIdx.x & 31) * 4;
    }
#pragma unroll
    for (int j = 0; j < A_COPIES; ++j) {
        const int r_off = (RP * j) % WTC_BM, k_off = 8 * ((RP * j) / WTC_BM);
        const float* src = A + (c.oa + ((unsigned)r_off * (unsigned)K + k_off));
        const uint32_t dst = c.a_dst + ws + 4 * (k_off * WTC_AS + r_off);
        if (CHECK) {
            const bool ok = r_off < a_rows && a_k + k_off < kl;
            wtc_cp4_n(dst, ok ? src : A, ok ? 4 : 0);
        } else {
            wtc_cp4(dst, src);
        }
    }
    const uint32_t b_base = c.b_dst + ws + 4 * (BK * WTC_AS);
#pragma unroll
    for (int i = 0; i < B_COPIES; ++i) {
        const float* src = B + (c.ob + (unsigned)(KP * i) * (unsigned)N);
        const uint32_t dst = b_base + 4 * (KP * i * WTC_BN);
        const bool k_ok = !CHECK || b_k + KP * i < kl;
        if (VEC) {           // N % 4 == 0: nl > 0 means all four columns are in range
            if (CHECK) {
                const bool ok = k_ok && nl > 0;
                wtc_cp16_n(dst, ok ? src : B, ok ? 16 : 0);
            } else {
                wtc_cp16(dst, src);
            }
        } else {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (CHECK) {
                    const bool ok = k_ok && q < nl;
                    wtc_cp4_n(dst + 4 * q, ok ? src + q : B, ok ? 4 : 0);
                } else {
                    wtc_cp4(dst + 4 * q, src + q);
                }
            }
        }
    }
}

// This thread's place: block corner (m0, n0); inside it the first A row and B column of its
// fragments. Warps of 32 x 8 TN (TN = 16: 4 x 1 warps of 32 x 128); lanes as in warptiled_1stage.
// asm volatile reads, so the epilogue recomputes it (see wt_place).
template <int TN>
__device__ __forceinline__ WtPlace wtc_place(int N) {
    unsigned tid, bid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bid));
    constexpr int WARP_N = 8 * TN, WARPS_N = WTC_BN / WARP_N;
    const int warp = tid >> 5, lane = tid & 31, nb = cdiv(N, WTC_BN);
    const int ty = ((lane >> 4) << 1) | (lane & 1), tx = (lane >> 1) & 7;
    return {(int)(bid / nb) * WTC_BM, (int)(bid % nb) * WTC_BN, (warp / WARPS_N) * 32 + ty * 4,
            (warp % WARPS_N) * WARP_N + tx * 4};
}

// One k step's fragments: 8 A values (rows a_off..+3, a_off + 16..+19) and TN B values (columns
// b_off + 32 h..+3), 2 + TN / 4 LDS.128.
template <int TN>
struct WtcFrag { float a[8]; float b[TN]; };

template <int TN, int BK>
__device__ __forceinline__ void wtc_load_frag(const float* stage, int k, int a_off, int b_off, WtcFrag<TN>& f) {
    const float* As = stage + k * WTC_AS + a_off;
    const float* Bs = stage + BK * WTC_AS + k * WTC_BN + b_off;
    const float4 a0 = *reinterpret_cast<const float4*>(As);
    const float4 a1 = *reinterpret_cast<const float4*>(As + 16);
    f.a[0] = a0.x; f.a[1] = a0.y; f.a[2] = a0.z; f.a[3] = a0.w;
    f.a[4] = a1.x; f.a[5] = a1.y; f.a[6] = a1.z; f.a[7] = a1.w;
#pragma unroll
    for (int h = 0; h < TN / 4; ++h) {
        const float4 v = *reinterpret_cast<const float4*>(Bs + 32 * h);
        f.b[4 * h] = v.x; f.b[4 * h + 1] = v.y; f.b[4 * h + 2] = v.z; f.b[4 * h + 3] = v.w;
    }
}

template <int TN>
__device__ __forceinline__ void wtc_fma(const WtcFrag<TN>& f, float (&acc)[8][TN]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] += f.a[i] * f.b[j];
}

// The loop state a tile step carries: the copy sources and the ring positions.
struct WtcRing {
    int kl;          // K - k0 of the next tile to issue (tile t + STAGES while tile t is computed)
    uint32_t st;     // byte offset of the stage computed from, which is also the one refilled
};

// One k tile: BK k steps from stage rs, with the fragments of step k + 1 loaded before the FMAs of
// step k (f[0] holds step 0 when called, and the next tile's step 0 on return). Before the last
// step's FMAs (its fragments are already in registers, every read of this stage issued): wait
// for the next tile's copies, __syncthreads, refill this stage with tile t + STAGES, and load the
// next tile's first fragments, whose latency the last step's FMAs then hide (CUTLASS's multistage
// loop). CHECK = false: tile t + STAGES lies inside A and B (interior block, kl >= BK).
template <int THREADS, int TN, int BK, int STAGES, bool VEC, bool CHECK>
__device__ __forceinline__ void wtc_tile(const float* A, const float* B, int M, int N, int K, const float* smem,
                                         WtcCopy& c, WtcRing& r, int a_off, int b_off, WtcFrag<TN> (&f)[2],
                                         float (&acc)[8][TN]) {
    constexpr uint32_t STAGE_BYTES = 4 * BK * (WTC_AS + WTC_BN);
    const float* stage = reinterpret_cast<const float*>(reinterpret_cast<const char*>(smem) + r.st);
#pragma unroll
    for (int k = 0; k < BK - 1; ++k) {
        wtc_load_frag<TN, BK>(stage, k + 1, a_off, b_off, f[(k + 1) & 1]);
        wtc_fma(f[k & 1], acc);
    }
    wtc_wait<STAGES - 2>();              // this thread's copies of tile t + 1 have landed
    __syncthreads();                     // everyone's have; everyone has read all of tile t
    if (!CHECK) {
        wtc_issue<THREADS, BK, VEC, false>(c, A, B, M, N, K, r.kl, r.st);
    } else if (r.kl > 0) {
        wtc_issue<THREADS, BK, VEC, true>(c, A, B, M, N, K, r.kl, r.st);
    }
    wtc_commit();                        // one group per tile, empty past the end
    c.oa += BK;
    c.ob += (unsigned)BK * (unsigned)N;
    r.kl -= BK;
    r.st = r.st == (STAGES - 1) * STAGE_BYTES ? 0 : r.st + STAGE_BYTES;
    stage = reinterpret_cast<const float*>(reinterpret_cast<const char*>(smem) + r.st);
    wtc_load_frag<TN, BK>(stage, 0, a_off, b_off, f[BK & 1]);          // past the last tile: unused
    wtc_fma(f[(BK - 1) & 1], acc);
}

template <int THREADS, int TN, int BK, int STAGES, bool VEC>
__device__ __forceinline__ void wtc_body(const float* __restrict__ A, const float* __restrict__ B,
                                         float* __restrict__ C, int M, int N, int K, float* smem) {
    constexpr uint32_t STAGE_BYTES = 4 * BK * (WTC_AS + WTC_BN);
    static_assert(THREADS * 8 * TN == WTC_BM * WTC_BN, "THREADS threads of 8 x TN outputs cover the tile");
    static_assert(WTC_BM * BK % THREADS == 0 && (BK * 32) % THREADS == 0 && BK % 8 == 0, "copy map");
    static_assert(STAGES >= 2 && BK % 2 == 0, "a ring; fragment buffers alternate");
    float acc[8][TN] = {};
    {
        const WtPlace p = wtc_place<TN>(N);
        const int tid = threadIdx.x;
        const int a_r = tid >> 3, a_k = tid & 7, b_k = tid >> 5, b_c = (tid & 31) * 4;
        WtcCopy c;
        c.oa = (unsigned)(p.m0 + a_r) * (unsigned)K + a_k;
        c.ob = (unsigned)b_k * (unsigned)N + p.n0 + b_c;
        c.a_dst = wtc_smem_u32(smem) + 4 * (a_k * WTC_AS + a_r);
        c.b_dst = wtc_smem_u32(smem) + 4 * (b_k * WTC_BN + b_c);
        const bool edge = M - p.m0 < WTC_BM || N - p.n0 < WTC_BN;

        // Prologue: tiles 0 .. STAGES - 1 into stages 0 .. STAGES - 1, one group each (maybe empty).
        WtcRing r{K, 0};
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            if (r.kl > 0) wtc_issue<THREADS, BK, VEC, true>(c, A, B, M, N, K, r.kl, s * STAGE_BYTES);
            wtc_commit();
            c.oa += BK;
            c.ob += (unsigned)BK * (unsigned)N;
            r.kl -= BK;
        }
        wtc_wait<STAGES - 1>();                      // tile 0 has landed
        __syncthreads();
        WtcFrag<TN> f[2];
        wtc_load_frag<TN, BK>(smem, 0, p.a_off, p.b_off, f[0]);
        // The tile computed is t, r.kl is K - k0 of tile t + STAGES, so tiles are left while
        // r.kl + STAGES * BK > 0. Interior blocks, while the tile to issue is whole, copy without
        // a single test; the rest (edge blocks, and the last STAGES + 1 tiles) with the tests.
        if (!edge) {
            while (r.kl >= BK)
                wtc_tile<THREADS, TN, BK, STAGES, VEC, false>(A, B, M, N, K, smem, c, r, p.a_off, p.b_off, f, acc);
        }
        while (r.kl > -STAGES * BK)
            wtc_tile<THREADS, TN, BK, STAGES, VEC, true>(A, B, M, N, K, smem, c, r, p.a_off, p.b_off, f, acc);
        wtc_wait<0>();              // only empty groups are left; leave none in flight
    }

    const WtPlace p = wtc_place<TN>(N);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = p.a_off + (i >> 2) * 16 + (i & 3);        // row inside the block tile
        if (r >= M - p.m0) continue;
        float* crow = C + (size_t)(p.m0 + r) * N + p.n0;
#pragma unroll
        for (int h = 0; h < TN / 4; ++h) {
            const int col = p.b_off + h * 32;                   // column inside the block tile
            const float* v = &acc[i][h * 4];
            if (VEC) {                                          // N % 4 == 0: col < N - n0 covers col + 3
                if (col < N - p.n0) *reinterpret_cast<float4*>(crow + col) = make_float4(v[0], v[1], v[2], v[3]);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) if (col + q < N - p.n0) crow[col + q] = v[q];
            }
        }
    }
}

#define WTC_KERNEL(name, THREADS, MIN_BLOCKS, TN, BK, STAGES, VEC)                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                                  \
    name(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, \
         int K) {                                                                                      \
        __shared__ __align__(16) float smem[STAGES * BK * (WTC_AS + WTC_BN)];                          \
        wtc_body<THREADS, TN, BK, STAGES, VEC>(A, B, C, M, N, K, smem);                                 \
    }
WTC_KERNEL(matmul_warptiled, 128, 2, 16, 8, 3, true)
WTC_KERNEL(matmul_warptiled_scalar, 128, 2, 16, 8, 3, false)
#undef WTC_KERNEL

// B copied 16 bytes at a time and C stored as float4s: N % 4 == 0, B and C 16-byte aligned. (A is
// copied 4 bytes at a time, so neither its alignment nor K matters.)
static int wtc_vec(const float* B, const float* C, int N) {
    return (N % 4 == 0) && ((uintptr_t)B % 16 == 0) && ((uintptr_t)C % 16 == 0);
}

extern "C" int launch_matmul_warptiled(const float* A, const float* B, float* C, int M, int N, int K,
                                       cudaStream_t stream) {
    const unsigned blocks = (unsigned)cdiv(N, WTC_BN) * (unsigned)cdiv(M, WTC_BM);
    if (wtc_vec(B, C, N)) matmul_warptiled<<<blocks, 128, 0, stream>>>(A, B, C, M, N, K);
    else matmul_warptiled_scalar<<<blocks, 128, 0, stream>>>(A, B, C, M, N, K);
    return (int)cudaGetLastError();
}
