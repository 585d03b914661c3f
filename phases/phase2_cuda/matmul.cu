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
// column of TM = 8 outputs of C (rows row0..row0+7, one column) in registers instead of one.
// Per k step a thread loads one B value into a register and reuses it for 8 FMAs; the 8 A values
// As[row0 + i][k] are the same for all 32 threads of a warp (one row0 per warp: a broadcast). As
// written that is 9 shared loads per 8 FMAs against the tiled kernel's 2 per FMA; and since a
// thread's As[row0 + i][0..7] are contiguous, the compiler (both loops unrolled) fetches each as
// 2 LDS.128 per tile: 8 LDS + 16 LDS.128 feed 64 FMAs, 0.375 load instructions per FMA (the
// tiled kernel: 2). What still limits it is the shared-memory pipe, which serves one 128-byte
// wavefront per clock per SM while the SM issues 4 warp-FFMAs: per warp per tile the 8 LDS are 8
// wavefronts and the 16 warp-uniform LDS.128 at least 2 each, 40 wavefronts for 64 FFMAs (16
// clocks of FMA issue per SM), so at most ~40% of the FMA peak; FFMAs are also only 47% of the
// main loop's instructions (sm_90 SASS). Global/L2 traffic: a 64x64 tile reads
// (64 + 64) x 8 x 4 B = 4 KB per 32K FMAs, 1/8 B per FMA (tiled 16x16: 1/2 B per FMA). Still
// scalar global loads (coalesced: a warp reads 32 consecutive B floats, and 4 rows x 32 bytes of
// A), A not transposed. Shared memory 2 x 2 KB; 50 registers, two 512-thread blocks per SM.
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
// Rungs 4 and 5, warptiled_1stage and warptiled: the CUDA-core kernel that closes the gap to cuBLAS.
// The per-thread work is coalesced_regblock's (an 8x8 register tile, 4 float4 shared loads feeding
// 64 FMAs per k step); what changes is everything around it.
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
// * warptiled only: double buffering. Two stages (16,640 B). The global loads of tile t+1 are
//   issued into 8 registers before tile t is computed from shared memory, and stored to the other
//   stage after it; one __syncthreads per tile, which both publishes stage t+1 and proves that
//   every warp finished reading the stage it will overwrite one tile later. The global latency is
//   hidden behind the warp's own FFMAs (ptxas issues the loads about 40% into the tile, ~300 FFMAs
//   before the stores that need them) instead of only behind other warps'.
//   warptiled_1stage is the same kernel with one stage (8,320 B): load, store, sync, compute, sync;
//   the step from it to warptiled is what double buffering buys on its own.
//
// Why BK = 8: at BK = 16 the 16 staging registers do not fit under the 128-register cap (ptxas
// spills, and sinks the loads to the end of the compute). At BK = 8 the main loop is, per thread
// per tile (sm_90 SASS): 512 FFMA, 32 LDS.128, 2 LDG.128, 4 STS + 1 STS.128, 1 BAR and ~24
// address/loop instructions, 576 in all: FFMAs 89% of issued instructions (the issue-rate ceiling;
// 94% would be the limit with no overhead at all). The shared/L1 pipe per warp per tile: 64
// wavefronts for the fragments, 8 for the stores, 8 to 20 for the global loads' data (A touches
// 16 lines of 32 B, B 4 of 128 B), against 128 SM-clocks of FFMA issue: about two thirds busy.
// Registers: 64 accumulators + 16 fragment values (+ the next k step's, loaded early) + 8 staged
// + pointers and bounds: 123 on sm_90, no spills.
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

template <bool VEC, int STAGES>
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

        if (STAGES == 2) {
            float* rd = smem;                 // the stage computed from
            float* wr = smem + WT_STAGE;      // the stage the next tile is stored to
            wt_load_tile<VEC>(pa, pb, N, K, a_ok, nl, ra, rb);
            wt_store_tile(rd, ra, rb);
            __syncthreads();
            for (int kl = K; kl > 0; kl -= WT_BK) {     // kl = K - k0: the k extent left
                // Tile k0 + BK into registers. No branch on kl > BK: past the end every load is
                // predicated off (zeros, stored to a stage nobody reads); with a branch here the
                // compiler sinks these loads below the compute, undoing the overlap.
                pa += WT_BK;
                pb += (size_t)WT_BK * N;
                wt_load_tile<VEC>(pa, pb, N, kl - WT_BK, a_ok, nl, ra, rb);
                wt_compute_tile(rd, p.a_off, p.b_off, acc);
                wt_store_tile(wr, ra, rb);
                __syncthreads();
                float* t = rd; rd = wr; wr = t;
            }
        } else {
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

#define WT_KERNEL(name, VEC, STAGES)                                                                   \
    extern "C" __global__ void __launch_bounds__(WT_THREADS, 2)                                        \
    name(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, \
         int K) {                                                                                      \
        __shared__ __align__(16) float smem[STAGES * WT_STAGE];                                        \
        warptiled_body<VEC, STAGES>(A, B, C, M, N, K, smem);                                            \
    }
WT_KERNEL(matmul_warptiled, true, 2)
WT_KERNEL(matmul_warptiled_scalar, false, 2)
WT_KERNEL(matmul_warptiled_1stage, true, 1)
WT_KERNEL(matmul_warptiled_1stage_scalar, false, 1)
#undef WT_KERNEL

static int wt_vec(const float* A, const float* B, const float* C, int N, int K) {
    return (K % 4 == 0) && (N % 4 == 0) && ((uintptr_t)A % 16 == 0) && ((uintptr_t)B % 16 == 0)
           && ((uintptr_t)C % 16 == 0);
}

extern "C" int launch_matmul_warptiled(const float* A, const float* B, float* C, int M, int N, int K,
                                       cudaStream_t stream) {
    const unsigned blocks = (unsigned)cdiv(N, WT_BN) * (unsigned)cdiv(M, WT_BM);
    if (wt_vec(A, B, C, N, K)) matmul_warptiled<<<blocks, WT_THREADS, 0, stream>>>(A, B, C, M, N, K);
    else matmul_warptiled_scalar<<<blocks, WT_THREADS, 0, stream>>>(A, B, C, M, N, K);
    return (int)cudaGetLastError();
}

extern "C" int launch_matmul_warptiled_1stage(const float* A, const float* B, float* C, int M, int N, int K,
                                              cudaStream_t stream) {
    const unsigned blocks = (unsigned)cdiv(N, WT_BN) * (unsigned)cdiv(M, WT_BM);
    if (wt_vec(A, B, C, N, K)) matmul_warptiled_1stage<<<blocks, WT_THREADS, 0, stream>>>(A, B, C, M, N, K);
    else matmul_warptiled_1stage_scalar<<<blocks, WT_THREADS, 0, stream>>>(A, B, C, M, N, K);
    return (int)cudaGetLastError();
}
