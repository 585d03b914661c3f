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

// ---------------------------------------------------------------------------------------------
// Rung 5, mma_bf16_pipelined: the same mma.sync.m16n8k16 instruction, fed the way Ampere-class
// GEMMs (CUTLASS's sm80 "multistage" kernels) feed it. C is bf16 (fp32 accumulators rounded once
// at the end), as cuBLAS's bf16 GEMM writes it.
//
// What changes from mma_bf16, and why each step matters:
// - Block tile 128 x 256, 8 warps in a 2 x 4 grid, each warp a 64 x 64 tile = 4 (m16) x 8 (n8)
//   accumulators = 128 fp32 registers per thread. Per k16 step a warp loads 4 KB of fragments
//   (64 rows of A + 64 columns of B, 16 k each) for 32 mma = 65,536 multiply-adds: 1/16 byte of
//   shared memory per multiply-add (mma_bf16's 32 x 32 warp tile needs 1/8, and loaded by hand
//   with 32-bit loads, 4x the instructions). A block reads each A and B element from global
//   memory once per 256 (resp. 128) outputs, instead of once per 64.
// - Global -> shared with cp.async.cg (16-byte copies that bypass registers and L1), into a ring
//   of STAGES tiles of BK = 64, 48 KB each (4 on Hopper, 3 on A100: as many as the GPU's
//   per-block shared memory allows): while the warps multiply tile kt, tiles kt+1 ..
//   kt+STAGES-1 are in flight. One commit_group per k tile (empty ones too, so the count stays
//   uniform); before reading tile kt+1, cp.async.wait_group STAGES-2 (the groups issued later
//   may still be pending) and a __syncthreads (other threads' copies, and everyone done reading
//   the slot refilled next).
// - Shared -> registers with ldmatrix.x4 (four 8x8 b16 matrices, one instruction), .trans for
//   B: B is stored k-major (rows of N contiguous), and the transposing load hands each thread
//   the (k = 2t, 2t+1; n = g) pairs the mma's B fragment wants.
// - XOR swizzle, 16-byte chunk granularity: chunk c of row r lives at chunk c ^ (r & 7). A rows
//   are 128 bytes (64 k), B rows 512 bytes (256 n). An ldmatrix phase reads one chunk column
//   of 8 consecutive rows: r & 7 takes all 8 values, so the 8 x 16 bytes hit 8 different
//   4-bank groups (conflict-free); a cp.async phase writes 8 consecutive chunks of one row,
//   which the XOR only permutes within their 128-byte line (conflict-free too).
// - Fragments double-buffered in registers: the ldmatrix for k16 step s+1 is issued before the
//   mma of step s, and across the tile boundary the first step of the next tile is loaded
//   right after the barrier, before the last mma batch of the current tile.
// - Grid order grouped by 8 block rows (blocks launched together share A rows and B columns
//   in L2).
// - Tails: 16-byte cp.async needs K % 8 == 0, N % 8 == 0 and 16-byte aligned A and B; then
//   out-of-range chunks are zero-filled (src-size 0) and M, N, K need not be tile multiples.
//   Otherwise the same kernel body loads with bounds-checked 2-byte global loads into the same
//   swizzled layout (matmul_mma_bf16_pipelined_scalar: correct, not fast). The epilogue is
//   bounds-checked and stores bf16x2 pairs when C and N allow 4-byte stores.
// - Split-K: when the tiles leave SMs idle (tall-skinny M <= 64, few tiles over a long K), the
//   launcher splits K by a rule of the shape and SM count (lab_mma_pipelined_split_k): grid y =
//   runs of K, fp32 partial sums to a pool workspace, matmul_mma_sum_splits adds them in a fixed
//   order. Warps whose 64 rows all lie past M copy and wait but issue no mma.
//
// Why this instruction caps out on Hopper (the point of the rung next to cuBLAS): the dense bf16
// peak is 4096 FLOP per clock per SM, so each of an SM's 4 schedulers would have to issue one
// m16n8k16 (2048 FMA) every 4 clocks, operands through the register file, besides the ldmatrix,
// cp.async, address and barrier instructions that feed it. And shared memory (128 bytes per clock
// per SM): each k16 step of a block moves 32 KB by ldmatrix plus 12 KB by cp.async for 524,288
// FMA, 352 clocks of shared memory against 256 of tensor math at peak, so even a perfect pipeline
// is held to 256 / 352 of peak. wgmma (matmul_wgmma.cu) reads B (and A) from shared memory by
// descriptor, once per warpgroup instruction, asynchronously: both limits go.
// ---------------------------------------------------------------------------------------------
namespace mmp {
constexpr int BM = 128, BN = 256, BK = 64, THREADS = 256;
constexpr int WM = 64, WN = 64, WARPS_N = BN / WN;         // 2 x 4 warps
constexpr int MI = WM / 16, NI = WN / 8, KSTEPS = BK / 16;  // 4 m16 tiles, 8 n8 tiles, 4 k16 steps
constexpr int A_ROW_BYTES = BK * 2, B_ROW_BYTES = BN * 2;   // 128, 512
constexpr int A_STAGE_BYTES = BM * A_ROW_BYTES;             // 16 KB
constexpr int B_STAGE_BYTES = BK * B_ROW_BYTES;             // 32 KB
constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;  // 48 KB
constexpr int MAX_STAGES = 4;
constexpr int A_LOADS = BM * (BK / 8) / THREADS;            // 4 16-byte chunks of A per thread per tile
constexpr int B_LOADS = BK * (BN / 8) / THREADS;            // 8 of B
constexpr int A_ROWS_PER_PASS = THREADS / (BK / 8);         // 32
constexpr int B_ROWS_PER_PASS = THREADS / (BN / 8);         // 8
constexpr int GROUP_M = 8;
static_assert(BM / WM * WARPS_N * 32 == THREADS, "8 warps");
static_assert(KSTEPS % 2 == 0, "fragment double-buffering alternates buffers across tiles");
static_assert(A_ROW_BYTES == 128 && B_ROW_BYTES % 128 == 0, "the XOR swizzle assumes 128-byte lines");
static_assert(A_ROWS_PER_PASS % 8 == 0 && B_ROWS_PER_PASS % 8 == 0, "row & 7 fixed per thread");

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, L2 only; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Wait until at most stages - 2 groups are pending (stages is 2..4, uniform across the block).
__device__ __forceinline__ void cp_async_wait_ring(int stages) {
    if (stages >= 4) cp_async_wait<2>();
    else if (stages == 3) cp_async_wait<1>();
    else cp_async_wait<0>();
}

__device__ __forceinline__ void st_shared_16(uint32_t dst, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 8 consecutive bf16 from p, the first `count` of them (0..8) real, the rest zero; 2-byte loads,
// so p needs only element alignment.
__device__ __forceinline__ uint4 load8_scalar(const unsigned short* p, int count) {
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int q = 0; q < 8; ++q)
        if (q < count) w[q / 2] |= static_cast<uint32_t>(p[q]) << (16 * (q % 2));
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The whole kernel; VEC: 16-byte cp.async (K % 8 == 0, N % 8 == 0, A and B 16-byte aligned),
// otherwise bounds-checked scalar loads. `stages` (2..MAX_STAGES) is the ring depth; the launch
// gives the kernel stages * STAGE_BYTES of dynamic shared memory.
template <bool VEC>
__device__ __forceinline__ void pipelined_body(const __nv_bfloat16* __restrict__ A,
                                               const __nv_bfloat16* __restrict__ B,
                                               __nv_bfloat16* __restrict__ C, int M, int N, int K,
                                               int pack, int stages, float* __restrict__ W) {
    extern __shared__ __align__(128) unsigned char mmp_smem[];
    const uint32_t smem0 = smem_u32(mmp_smem);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;

    // Block (pid_m, pid_n), grouped: GROUP_M block rows are walked column by column.
    const int num_m = (M + BM - 1) / BM, num_n = (N + BN - 1) / BN;
    const int width = GROUP_M * num_n, pid = blockIdx.x;
    const int first_m = (pid / width) * GROUP_M;
    const int group_rows = min(num_m - first_m, GROUP_M);
    const int pid_m = first_m + (pid % width) % group_rows, pid_n = (pid % width) / group_rows;
    const int m0 = pid_m * BM, n0 = pid_n * BN;

    // This thread's copy slots: A row tid/8 (+32 i), k chunk tid%8; B k row tid/32 (+8 j), n chunk
    // tid%32. Swizzled shared offsets within a stage (row & 7 is the same for every i, j), and
    // running global pointers advanced one tile per load (few registers: the accumulators and
    // fragments already take 192).
    const unsigned short* Ag = reinterpret_cast<const unsigned short*>(A);
    const unsigned short* Bg = reinterpret_cast<const unsigned short*>(B);
    const int a_row = tid / (BK / 8), a_chunk = tid % (BK / 8);
    const int b_row = tid / (BN / 8), b_chunk = tid % (BN / 8);
    const uint32_t a_soff = a_row * A_ROW_BYTES + ((a_chunk ^ (a_row & 7)) << 4);
    const uint32_t b_soff = A_STAGE_BYTES + b_row * B_ROW_BYTES + ((b_chunk ^ (b_row & 7)) << 4);
    // Split-K (W != nullptr): block row y takes the k-tiles [k_lo, k_hi) of run y of gridDim.y and
    // writes fp32 partial sums to W[y] (the launcher keeps runs >= 4 k-tiles each).
    const int KT_ALL = (K + BK - 1) / BK;
    const int k_lo = (int)((long long)blockIdx.y * KT_ALL / gridDim.y);
    const int k_hi = (int)((long long)(blockIdx.y + 1) * KT_ALL / gridDim.y);
    const int a_gm = m0 + a_row, b_gn = n0 + b_chunk * 8;
    int a_gk = a_chunk * 8 + k_lo * BK, b_gk = b_row + k_lo * BK;   // k of this thread's chunks, next tile
    const size_t a_pass = (size_t)A_ROWS_PER_PASS * K, b_pass = (size_t)B_ROWS_PER_PASS * N;
    const unsigned short* a_src = Ag + (size_t)a_gm * K + a_gk;   // may point past A: only
    const unsigned short* b_src = Bg + (size_t)b_gk * N + b_gn;   // dereferenced where in range
    uint32_t a_rows_ok = 0;
#pragma unroll
    for (int i = 0; i < A_LOADS; ++i) a_rows_ok |= (a_gm + i * A_ROWS_PER_PASS < M) ? 1u << i : 0u;
    const bool b_col_ok = b_gn < N;

    // Next tile (in k order) into `slot`. The scalar path is kept rolled (it is the fallback for
    // unaligned operands; unrolled, its 96 loads in flight would spill the accumulators).
    auto load_tile = [&](int slot) {
        const uint32_t base = smem0 + slot * STAGE_BYTES;
        if constexpr (VEC) {
#pragma unroll
            for (int i = 0; i < A_LOADS; ++i) {
                const bool ok = ((a_rows_ok >> i) & 1u) && a_gk < K;
                cp_async_16(base + a_soff + i * A_ROWS_PER_PASS * A_ROW_BYTES, ok ? a_src + i * a_pass : Ag,
                            ok ? 16 : 0);
            }
#pragma unroll
            for (int j = 0; j < B_LOADS; ++j) {
                const bool ok = b_gk + j * B_ROWS_PER_PASS < K && b_col_ok;
                cp_async_16(base + b_soff + j * B_ROWS_PER_PASS * B_ROW_BYTES, ok ? b_src + j * b_pass : Bg,
                            ok ? 16 : 0);
            }
        } else {
#pragma unroll 1
            for (int i = 0; i < A_LOADS; ++i) {
                const int count = ((a_rows_ok >> i) & 1u) ? max(0, min(8, K - a_gk)) : 0;
                st_shared_16(base + a_soff + i * A_ROWS_PER_PASS * A_ROW_BYTES,
                             load8_scalar(count ? a_src + i * a_pass : Ag, count));
            }
#pragma unroll 1
            for (int j = 0; j < B_LOADS; ++j) {
                const int count = b_gk + j * B_ROWS_PER_PASS < K ? max(0, min(8, N - b_gn)) : 0;
                st_shared_16(base + b_soff + j * B_ROWS_PER_PASS * B_ROW_BYTES,
                             load8_scalar(count ? b_src + j * b_pass : Bg, count));
            }
        }
        a_src += BK;
        a_gk += BK;
        b_src += (size_t)BK * N;
        b_gk += BK;
    };

    // Fragments of k16 step ks of the tile in `slot`. A (16 x 16 per m16 tile, ldmatrix.x4):
    // lane l gives the address of row l % 16, k chunk 2 ks + l / 16, so the four 8x8 matrices are
    // (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = registers a0a1, a2a3, a4a5,
    // a6a7 of the PTX fragment (row g / g + 8, k 2t / 2t + 8). B (16 k x 16 n per pair of n8
    // tiles, ldmatrix.x4.trans): lane l gives k row l % 16, n chunk l / 16; the matrices are
    // (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) = b0b1, b2b3 of the
    // first n8 tile, then of the second (k 2t / 2t + 8, n g).
    // Swizzle: A's row (wm + 16 mi + l % 16) and B's k row (16 ks + l % 16) are both = l (mod 8),
    // and the logical chunk is 2q + l / 16 (q = ks for A; q = nj, after the warp's 8-chunk-aligned
    // n offset, for B), so the physical chunk is 2q ^ xsw with xsw = (l / 16) ^ (l & 7).
    const int xsw = (lane >> 4) ^ (lane & 7);
    const uint32_t a_frag = (wm + (lane & 15)) * A_ROW_BYTES;
    const uint32_t b_frag = A_STAGE_BYTES + (lane & 15) * B_ROW_BYTES + (wn >> 3) * 16;
    auto load_frags = [&](uint32_t (&af)[MI][4], uint32_t (&bf)[NI][2], int slot, int ks) {
        const uint32_t base = smem0 + slot * STAGE_BYTES;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
            ldmatrix_x4(af[mi], base + a_frag + mi * 16 * A_ROW_BYTES + (((2 * ks) ^ xsw) << 4));
#pragma unroll
        for (int nj = 0; nj < NI / 2; ++nj) {
            uint32_t r[4];
            ldmatrix_x4_trans(r, base + b_frag + ks * 16 * B_ROW_BYTES + (((2 * nj) ^ xsw) << 4));
            bf[2 * nj][0] = r[0];
            bf[2 * nj][1] = r[1];
            bf[2 * nj + 1][0] = r[2];
            bf[2 * nj + 1][1] = r[3];
        }
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;
    uint32_t af[2][MI][4], bf[2][NI][2];

    // Prologue: tiles 0 .. stages-2 in flight, one commit group each (empty past the last tile).
    const int KT = k_hi - k_lo;                             // this block's k-tiles
    const bool idle = m0 + wm >= M;                         // none of this warp's 64 rows is in C
    for (int s = 0; s < stages - 1; ++s) {
        if (s < KT) load_tile(s);
        if constexpr (VEC) cp_async_commit();
    }
    if constexpr (VEC) cp_async_wait_ring(stages);          // group 0 (tile 0) has landed
    __syncthreads();
    load_frags(af[0], bf[0], 0, 0);

    int read_slot = 0, write_slot = stages - 1;
#pragma unroll 1
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            if (ks == KSTEPS - 1) {
                // Committed so far: (stages - 1) + (kt + 1) groups, group i = tile i. At most
                // stages - 2 pending means groups 0 .. kt + 1 are complete: this thread's part of
                // tile kt + 1 is in shared memory. The barrier makes every thread's part visible,
                // and orders all warps' reads of slot kt % stages (done: the last fragments of
                // tile kt were loaded at step KSTEPS - 2) before its refill in iteration kt + 1.
                if constexpr (VEC) cp_async_wait_ring(stages);
                __syncthreads();
                read_slot = (read_slot + 1 == stages) ? 0 : read_slot + 1;
            }
            // Next step's fragments (ks + 1 of this tile, or step 0 of tile kt + 1).
            load_frags(af[(ks + 1) & 1], bf[(ks + 1) & 1], read_slot, (ks + 1) % KSTEPS);
            if (ks == 0) {
                // Refill the slot of tile kt - 1: every warp read it before the barrier of
                // iteration kt - 1 (its last fragments were loaded at step KSTEPS - 2).
                if (kt + stages - 1 < KT) load_tile(write_slot);    // tile kt + stages - 1
                if constexpr (VEC) cp_async_commit();
                write_slot = (write_slot + 1 == stages) ? 0 : write_slot + 1;
            }
            if (idle) continue;                             // copies and barriers only
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int n = 0; n < NI; ++n) {
                    const int ni = (mi & 1) ? NI - 1 - n : n;   // serpentine: reuse the B registers
                    mma_m16n8k16_bf16(acc[mi][ni], af[ks & 1][mi], bf[ks & 1][ni]);
                }
        }
    }
    if constexpr (VEC) cp_async_wait<0>();                  // only empty groups can be left

    // Epilogue: c0, c1 at (g, 2t .. 2t + 1), c2, c3 at (g + 8, ...) of each 16 x 8 tile.
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int gm = m0 + wm + mi * 16 + g + 8 * h, gn = n0 + wn + ni * 8 + 2 * t;
                if (gm >= M) continue;
                const float x = acc[mi][ni][2 * h], y = acc[mi][ni][2 * h + 1];
                if (W != nullptr) {                         // a run of K: fp32 partial sums
                    float* q = W + ((size_t)blockIdx.y * M + gm) * N + gn;
                    if (N % 2 == 0 && gn + 1 < N) {
                        *reinterpret_cast<float2*>(q) = make_float2(x, y);
                    } else {
                        if (gn < N) q[0] = x;
                        if (gn + 1 < N) q[1] = y;
                    }
                    continue;
                }
                __nv_bfloat16* p = C + (size_t)gm * N + gn;
                if (pack && gn + 1 < N) {
                    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
                } else {
                    if (gn < N) p[0] = __float2bfloat16_rn(x);
                    if (gn + 1 < N) p[1] = __float2bfloat16_rn(y);
                }
            }
}
}  // namespace mmp

extern "C" __global__ void __launch_bounds__(mmp::THREADS, 1)
matmul_mma_bf16_pipelined(const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B,
                          __nv_bfloat16* __restrict__ C, int M, int N, int K, int pack, int stages,
                          float* __restrict__ W) {
    mmp::pipelined_body<true>(A, B, C, M, N, K, pack, stages, W);
}

extern "C" __global__ void __launch_bounds__(mmp::THREADS, 1)
matmul_mma_bf16_pipelined_scalar(const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B,
                                 __nv_bfloat16* __restrict__ C, int M, int N, int K, int pack, int stages,
                                 float* __restrict__ W) {
    mmp::pipelined_body<false>(A, B, C, M, N, K, pack, stages, W);
}

// Split-K's second kernel: C = sum over runs s = 0, 1, ... of W[s] (fp32), in that order (the same
// bits every run, unlike atomics), rounded once to bf16. One thread per element, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
matmul_mma_sum_splits(const float* __restrict__ W, __nv_bfloat16* __restrict__ C, int M, int N, int splits) {
    const size_t total = static_cast<size_t>(M) * N;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        float sum = 0.f;
        for (int s = 0; s < splits; ++s) sum += W[s * total + i];
        C[i] = __float2bfloat16_rn(sum);
    }
}

// The split of K, as matmul_wgmma.cu's split_k_rule for this rung's 128 x 256 tiles and one CTA
// per SM (rungs.split_k mirrors it; a CPU test compares them): 1 when the tiles fill the SMs, else
// enough runs to cover them once, at most 16, each >= 4 k-tiles of 64, the fp32 partial sums
// within a quarter of A's and B's bytes.
extern "C" int lab_mma_pipelined_split_k(int M, int N, int K, int sms) {
    if (M <= 0 || N <= 0 || K <= 0 || sms <= 0) return 1;
    const long long tiles = (long long)((M + mmp::BM - 1) / mmp::BM) * ((N + mmp::BN - 1) / mmp::BN);
    if (tiles >= sms) return 1;
    const long long KT = (K + mmp::BK - 1) / mmp::BK;
    long long split = (sms + tiles - 1) / tiles;
    split = split < 16 ? split : 16;
    split = split < KT / 4 ? split : KT / 4;
    const long long by_traffic = ((long long)M * K + (long long)K * N) * 2 / (32LL * M * N);
    split = split < by_traffic ? split : by_traffic;
    return split > 1 ? (int)split : 1;
}

// stages: 2..4, or 0 for the deepest ring this GPU's per-block shared memory allows (4 x 48 KB
// on Hopper, 3 on A100, 2 on GPUs with ~100 KB). Returns a cudaError_t. The opt-in shared-memory
// limit and the kernels' dynamic shared-memory attribute are cached per device (a benign race:
// every writer writes the same value), so after the first launch a launch makes no extra calls.
extern "C" int launch_matmul_mma_bf16_pipelined_stages(const __nv_bfloat16* A, const __nv_bfloat16* B,
                                                       __nv_bfloat16* C, int M, int N, int K, int stages,
                                                       cudaStream_t stream) {
    constexpr int MAX_DEVICES = 64;
    static int optin_cache[MAX_DEVICES];                 // 0: not read yet
    static int attr_set[2][MAX_DEVICES];                 // 1: dynamic smem limit raised, per kernel
    if (M <= 0 || N <= 0) return 0;
    if (stages != 0 && (stages < 2 || stages > mmp::MAX_STAGES)) return (int)cudaErrorInvalidValue;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
    const bool cached = dev >= 0 && dev < MAX_DEVICES;
    int optin = cached ? optin_cache[dev] : 0;
    if (optin == 0) {
        e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
        if (cached) optin_cache[dev] = optin;
    }
    const int limit = min(optin, mmp::MAX_STAGES * mmp::STAGE_BYTES);
    if (stages == 0) stages = max(2, limit / mmp::STAGE_BYTES);
    const int smem = stages * mmp::STAGE_BYTES;
    if (smem > limit) return (int)cudaErrorInvalidValue;
    const bool vec = (K % 8 == 0) && (N % 8 == 0) && ((uintptr_t)A % 16 == 0) && ((uintptr_t)B % 16 == 0);
    const int pack = (N % 2 == 0) && ((uintptr_t)C % 4 == 0);
    auto kernel = vec ? matmul_mma_bf16_pipelined : matmul_mma_bf16_pipelined_scalar;
    if (!cached || !attr_set[vec][dev]) {               // once: allow every ring depth that fits
        e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
        if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
        if (cached) attr_set[vec][dev] = 1;
    }
    const long long blocks = (long long)((M + mmp::BM - 1) / mmp::BM) * ((N + mmp::BN - 1) / mmp::BN);
    if (K <= 0) return (int)cudaMemsetAsync(C, 0, (size_t)M * N * sizeof(__nv_bfloat16), stream);
    static int sm_cache[MAX_DEVICES];
    int sms = cached ? sm_cache[dev] : 0;
    if (sms == 0) {
        e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
        if (cached) sm_cache[dev] = sms;
    }
    const int splits = lab_mma_pipelined_split_k(M, N, K, sms);
    float* W = nullptr;
    if (splits > 1) {
        // Workspace from the device's default pool, which keeps what it has (set once; torch
        // allocates from its own caching allocator, not this pool).
        static int pool_kept[MAX_DEVICES];
        if (!cached || !pool_kept[dev]) {
            cudaMemPool_t pool;
            uint64_t keep_all = ~0ull;
            e = cudaDeviceGetDefaultMemPool(&pool, dev);
            if (e == cudaSuccess) e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
            if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
            if (cached) pool_kept[dev] = 1;
        }
        e = cudaMallocAsync(reinterpret_cast<void**>(&W), (size_t)splits * M * N * sizeof(float), stream);
        if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
    }
    kernel<<<dim3((unsigned)blocks, (unsigned)splits), mmp::THREADS, smem, stream>>>(A, B, C, M, N, K, pack, stages, W);
    e = cudaGetLastError();
    if (splits > 1) {
        if (e == cudaSuccess) {
            const long long sum_blocks = ((long long)M * N + 255) / 256;
            matmul_mma_sum_splits<<<(unsigned)(sum_blocks < 8LL * sms ? sum_blocks : 8LL * sms), 256, 0, stream>>>(
                W, C, M, N, splits);
            e = cudaGetLastError();
        }
        cudaError_t f = cudaFreeAsync(W, stream);
        if (e == cudaSuccess) e = f;
    }
    return (int)e;
}

extern "C" int launch_matmul_mma_bf16_pipelined(const __nv_bfloat16* A, const __nv_bfloat16* B, __nv_bfloat16* C,
                                                int M, int N, int K, cudaStream_t stream) {
    return launch_matmul_mma_bf16_pipelined_stages(A, B, C, M, N, K, 0, stream);
}
