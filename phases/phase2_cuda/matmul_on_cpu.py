"""A lesson in checking GPU kernels without a GPU: matmul.cu's fp32 rungs, the real source, compiled
by g++ and run on the CPU, one OS thread per CUDA thread, under sanitizers.

    python -m phases.phase2_cuda.matmul_on_cpu [--rungs warptiled] [--quick] [--banks-only]

matmul.cu is rewritten just enough to be C++ (launches become calls of an emulated launch, the
thread-index reads, cp.async, commit_group and wait_group become calls of a small shim): each block
runs as one std::thread per CUDA thread, `__syncthreads()` is a std::barrier, `__shared__` arrays
are statics. Each cp.async lands at the latest moment the PTX rules allow, so a tile read before
its wait is read stale. Three builds: AddressSanitizer + UBSan (every operand at its exact size, C
starting as NaN, the result against a float64 product), ThreadSanitizer (a shared-memory access
not ordered by a barrier is a race whatever the timing), and TSan with each copy performed at issue
(a stage refilled before every thread's last read of it). Then the warptiled kernels' shared-memory
patterns (bank conflicts, paired lanes) are computed from the same address expressions.
It cannot check anything about the GPU itself: timing, the code nvcc emits, warp-synchronous behaviour.
"""
import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .rungs import RUNGS

SOURCE = Path(__file__).resolve().parent / "matmul.cu"
LAUNCHERS = {k: r.launcher for k, r in RUNGS.items() if r.source == "matmul.cu"}
DEFAULT = ("regblock_1d", "warptiled_1stage", "warptiled")
# (M, N, K, offset): offset 1 = A, B, C one float off 16 bytes; 2 = only C. The GPU tests' shapes,
# then float4-path shapes with M, N, K tails, then unaligned views. The last three are small enough
# for --quick and TSan and still reach warptiled's unchecked copies (a whole 128 x 128 tile, K >= 32).
SHAPES = [(1, 1, 1, 0), (17, 33, 9, 0), (64, 64, 64, 0), (128, 96, 200, 0), (65, 130, 31, 0),
          (1000, 777, 555, 0), (1000, 776, 556, 0), (300, 4, 1036, 0), (130, 264, 200, 0), (1, 4, 4, 0),
          (129, 260, 4, 0), (40, 520, 64, 0), (64, 64, 64, 1), (257, 132, 12, 1), (130, 264, 200, 2),
          (128, 128, 40, 0), (256, 132, 44, 0), (256, 132, 44, 1)]
QUICK_MAX = 2_000_000                 # --quick and the TSan build: shapes with M * N * K up to this

SHIM = r'''
#pragma once
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <cstring>
#include <deque>
struct dim3 { unsigned x, y, z; dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {} };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<>* emu_bar = nullptr;
inline void __syncthreads() { emu_bar->arrive_and_wait(); }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __restrict__ __restrict
typedef void* cudaStream_t;
typedef int cudaError_t;
inline int emu_error = 0;
inline int cudaGetLastError() { int e = emu_error; emu_error = 0; return e; }
inline const char* cudaGetErrorString(int) { return "emulated launch error"; }
inline long long emu_blocks = 0;
// cp.async: a shared address is its offset from emu_anchor (32 bits, as cvta.to.shared gives).
inline char emu_anchor;
inline uint32_t __cvta_generic_to_shared(const void* p) { return (uint32_t)((intptr_t)p - (intptr_t)&emu_anchor); }
struct EmuCp { uint32_t dst; const char* src; int n, src_n; };
inline thread_local std::deque<std::vector<EmuCp>> emu_groups;   // committed, oldest first
inline thread_local std::vector<EmuCp> emu_pending;              // the open group
inline void emu_do(const EmuCp& c) {
    char* d = &emu_anchor + (int32_t)c.dst;
    if ((uintptr_t)d % c.n) { fprintf(stderr, "Sanitizer: misaligned cp.async dst\n"); abort(); }
    if ((uintptr_t)c.src % c.n) { fprintf(stderr, "Sanitizer: misaligned cp.async src\n"); abort(); }
    char tmp[16] = {0};
    if (c.src_n) memcpy(tmp, c.src, c.src_n);   // src-size bytes read, the rest zeros
    memcpy(d, tmp, c.n);
}
inline void emu_cp(uint32_t dst, const void* src, int n, int src_n) {
#ifdef EMU_EAGER
    emu_do({dst, (const char*)src, n, src_n});
#else
    emu_pending.push_back({dst, (const char*)src, n, src_n});
#endif
}
inline void emu_commit() { emu_groups.push_back(std::move(emu_pending)); emu_pending.clear(); }
inline void emu_wait(int keep) {
    while ((int)emu_groups.size() > keep) { for (auto& c : emu_groups.front()) emu_do(c); emu_groups.pop_front(); }
}
template <class... P, class... Args>
void emu_launch(void (*k)(P...), dim3 grid, dim3 block, Args... args) {
    if (grid.x == 0 || grid.y == 0 || grid.y > 65535 || block.x * block.y > 1024) { emu_error = 9; return; }
    gridDim = grid; blockDim = block;
    const unsigned nt = block.x * block.y;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            std::barrier<> bar(nt);
            emu_bar = &bar;
            std::vector<std::thread> ts;
            ts.reserve(nt);
            for (unsigned t = 0; t < nt; ++t)
                ts.emplace_back([&, t] {
                    threadIdx = dim3(t % block.x, t / block.x);
                    blockIdx = dim3(bx, by);
                    k(args...);
                    bar.arrive_and_drop();   // no kernel here has a barrier after an early return
                });
            for (auto& th : ts) th.join();
            ++emu_blocks;
        }
}
'''

DRIVER = r'''
#include "shim.h"
#include "matmul_emu.cpp"
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
typedef int (*Launcher)(const float*, const float*, float*, int, int, int, cudaStream_t);

static int check(const char* name, Launcher fn, int M, int N, int K, int offset, unsigned seed) {
    std::mt19937 g(seed);
    std::normal_distribution<float> d;
    const int oab = offset == 1, oc = offset != 0;
    float* abuf = new float[(size_t)M * K + oab];   // exact sizes: ASan catches any access past them
    float* bbuf = new float[(size_t)K * N + oab];
    float* cbuf = new float[(size_t)M * N + oc];
    float *A = abuf + oab, *B = bbuf + oab, *C = cbuf + oc;
    for (size_t i = 0; i < (size_t)M * K; ++i) A[i] = d(g);
    for (size_t i = 0; i < (size_t)K * N; ++i) B[i] = d(g);
    for (size_t i = 0; i < (size_t)M * N; ++i) C[i] = NAN;
    long long before = emu_blocks;
    int rc = fn(A, B, C, M, N, K, nullptr);
    double err2 = 0, ref2 = 0;
    long nan = 0;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            double r = 0;
            for (int k = 0; k < K; ++k) r += (double)A[(size_t)i * K + k] * B[(size_t)k * N + j];
            double o = C[(size_t)i * N + j];
            if (std::isnan(o)) { ++nan; continue; }
            err2 += (o - r) * (o - r);
            ref2 += r * r;
        }
    double rel = std::sqrt(err2 / ref2);
    bool ok = rc == 0 && nan == 0 && rel < 5e-5;
    printf("[%s] %-20s %5d x %5d x %5d %-14s %4lld blocks  unwritten %ld  rel err %.2e\n", ok ? "ok  " : "FAIL",
           name, M, N, K, offset == 1 ? "(views off 16)" : offset == 2 ? "(C off 16)" : "", emu_blocks - before,
           nan, rel);
    delete[] abuf; delete[] bbuf; delete[] cbuf;
    return !ok;
}

// The shared-memory wavefronts of one warp's LDS.128 at byte addresses addr[0..31]: the worst
// bank's count of distinct 4-byte words, times 2 when pairs of lanes (L, L^1 or L, L^2) read the
// same float4 (a half-warp per wavefront), else 4. Misaligned addresses are counted into `bad`.
static int lds128_wavefronts(const long (&addr)[32], int& bad, int* conflict_out = nullptr,
                             size_t* distinct_out = nullptr, bool* p1_out = nullptr, bool* p2_out = nullptr) {
    for (int l = 0; l < 32; ++l) bad += addr[l] % 16 != 0;
    std::set<long> distinct(addr, addr + 32);
    std::map<int, std::set<long>> bank;
    for (long a : distinct) for (int w = 0; w < 4; ++w) bank[(a / 4 + w) % 32].insert(a / 4 + w);
    int conflict = 0;
    for (auto& b : bank) conflict = std::max(conflict, (int)b.second.size());
    bool p1 = true, p2 = true;
    for (int l = 0; l < 32; ++l) { p1 &= addr[l] == addr[l ^ 1]; p2 &= addr[l] == addr[l ^ 2]; }
    if (conflict_out) *conflict_out = conflict;
    if (distinct_out) *distinct_out = distinct.size();
    if (p1_out) *p1_out = p1;
    if (p2_out) *p2_out = p2;
    return (p1 || p2 ? 2 : 4) * conflict;
}

static int banks() {
    int worst_lds = 0, worst_sts = 0, bad = 0;
    for (int warp = 0; warp < WT_THREADS / 32; ++warp) {
        int a_off[32], b_off[32];
        for (int lane = 0; lane < 32; ++lane) {
            threadIdx = dim3(warp * 32 + lane);
            blockIdx = dim3(0);
            WtPlace p = wt_place(4096);
            a_off[lane] = p.a_off;
            b_off[lane] = p.b_off;
        }
        for (int k = 0; k < WT_BK; ++k)
            for (int which = 0; which < 4; ++which) {        // wt_compute_tile's a0, a1, b0, b1
                long addr[32];
                for (int l = 0; l < 32; ++l) {
                    long f = which == 0 ? k * WT_AS + a_off[l] : which == 1 ? k * WT_AS + a_off[l] + 16
                           : which == 2 ? WT_BK * WT_AS + k * WT_BN + b_off[l]
                           : WT_BK * WT_AS + k * WT_BN + b_off[l] + 32;
                    addr[l] = 4 * f;
                }
                int conflict;
                size_t distinct;
                bool p1, p2;
                int wavefronts = lds128_wavefronts(addr, bad, &conflict, &distinct, &p1, &p2);
                worst_lds = std::max(worst_lds, wavefronts);
                if (warp == 0 && k == 0)
                    printf("  LDS.128 %s%d: %zu distinct float4s, %d-way bank conflict, lanes L,L^1 share: %s, "
                           "L,L^2 share: %s -> %d wavefronts\n", which < 2 ? "a" : "b", which % 2, distinct,
                           conflict, p1 ? "yes" : "no", p2 ? "yes" : "no", wavefronts);
            }
        for (int pad = 0; pad < 2; ++pad)
            for (int j = 0; j < 4; ++j) {                      // wt_store_tile's transposing stores
                std::map<int, std::set<long>> bank;
                for (int l = 0; l < 32; ++l) {
                    int tid = warp * 32 + l, a_r = tid >> 1, a_k = (tid & 1) * 4;
                    long w = (long)(a_k + j) * (pad ? WT_AS : WT_BM) + a_r;
                    bank[w % 32].insert(w);
                }
                int conflict = 0;
                for (auto& b : bank) conflict = std::max(conflict, (int)b.second.size());
                if (pad) worst_sts = std::max(worst_sts, conflict);
                else if (warp == 0 && j == 0) printf("  transposing STS without the padding (rows of %d): %d-way\n", WT_BM, conflict);
            }
    }
    printf("  all warps, all k: worst LDS.128 %d wavefronts, worst transposing STS %d-way, misaligned %d\n",
           worst_lds, worst_sts, bad);
    return !(worst_lds == 2 && worst_sts == 1 && bad == 0);
}

// warptiled: wtc_place<16> and wtc_load_frag<16, 8>'s addresses (2 A and 4 B float4s per k step), and
// the banks of wtc_issue's 4-byte A copies (copy j of thread tid: As[tid % 8][tid / 8 + 16 j]).
static int banks_wtc() {
    constexpr int THREADS = 128, TN = 16, BK = 8;
    int worst_lds = 0, worst_cp = 0, bad = 0;
    for (int warp = 0; warp < THREADS / 32; ++warp) {
        int a_off[32], b_off[32];
        for (int lane = 0; lane < 32; ++lane) {
            threadIdx = dim3(warp * 32 + lane);
            blockIdx = dim3(0);
            WtPlace p = wtc_place<TN>(4096);
            a_off[lane] = p.a_off;
            b_off[lane] = p.b_off;
        }
        for (int k = 0; k < BK; ++k)
            for (int which = 0; which < 2 + TN / 4; ++which) {
                long addr[32];
                for (int l = 0; l < 32; ++l) {
                    long f = which < 2 ? k * WTC_AS + a_off[l] + 16 * which
                                       : BK * WTC_AS + k * WTC_BN + b_off[l] + 32 * (which - 2);
                    addr[l] = 4 * f;
                }
                worst_lds = std::max(worst_lds, lds128_wavefronts(addr, bad));
            }
        for (int j = 0; j < WTC_BM * BK / THREADS; ++j) {
            std::map<int, std::set<long>> bank;
            for (int l = 0; l < 32; ++l) {
                int tid = warp * 32 + l;
                long w = (long)(tid & 7) * WTC_AS + (tid >> 3) + 16 * j;
                bank[w % 32].insert(w);
            }
            int conflict = 0;
            for (auto& b : bank) conflict = std::max(conflict, (int)b.second.size());
            worst_cp = std::max(worst_cp, conflict);
        }
    }
    printf("  warptiled, all warps, all k: worst LDS.128 %d wavefronts, worst transposing cp.async %d-way, "
           "misaligned %d\n", worst_lds, worst_cp, bad);
    return !(worst_lds == 2 && worst_cp == 1 && bad == 0);
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);
    std::map<std::string, Launcher> fns = {@LAUNCHERS@};
    if (argc > 1 && std::string(argv[1]) == "banks") return banks() | banks_wtc();
    // argv: name M N K offset seed
    return check(argv[1], fns.at(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]));
}
'''


def prepare(text: str) -> str:
    """matmul.cu -> C++ the shim can compile."""
    text = re.sub(r"#include <cuda[^>]*>\n", "", text)
    text = re.sub(r"(\w+)<<<([^,>]+),\s*([^,>]+),\s*[^,>]+,\s*\w+>>>\(", r"emu_launch(\1, \2, \3, ", text)
    text = text.replace('asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));', "tid = threadIdx.x;")
    text = text.replace('asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bid));', "bid = blockIdx.x;")
    text = re.sub(r'asm volatile\("cp\.async\.c[ag]\.shared\.global \[%0\], \[%1\], (\d+);\\n" ::"r"\(dst\), '
                  r'"l"\(src\) : "memory"\);', r"emu_cp(dst, src, \1, \1);", text)
    text = re.sub(r'asm volatile\("cp\.async\.c[ag]\.shared\.global \[%0\], \[%1\], (\d+), %2;\\n" ::"r"\(dst\), '
                  r'"l"\(src\), "r"\(src_bytes\) : "memory"\);', r"emu_cp(dst, src, \1, src_bytes);", text)
    text = text.replace('asm volatile("cp.async.commit_group;\\n" ::: "memory");', "emu_commit();")
    text = text.replace('asm volatile("cp.async.wait_group %0;\\n" ::"n"(N) : "memory");', "emu_wait(N);")
    left = [ln for ln in text.splitlines() if "<<<" in ln or re.search(r"\basm\s+volatile\s*\(", ln)]
    if left:
        raise SystemExit(f"matmul_on_cpu: cannot rewrite these lines of matmul.cu: {left}")
    return text


def build(folder: Path, sanitizers: str, name: str, defines: tuple = ()) -> Path:
    exe = folder / name
    cmd = ["g++", "-std=c++20", "-O1", "-g", "-pthread", *(f"-D{d}" for d in defines),
           f"-fsanitize={sanitizers}", "-o", str(exe), str(folder / "driver.cpp")]
    if "undefined" in sanitizers:
        cmd.insert(-3, "-fno-sanitize-recover=undefined")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"matmul_on_cpu: g++ failed:\n{proc.stderr[-3000:]}")
    return exe


def run_case(exe: Path, rung: str, shape: tuple, seed: int, what: str) -> bool:
    m, n, k, off = shape
    proc = subprocess.run([str(exe), rung, str(m), str(n), str(k), str(off), str(seed)], capture_output=True,
                          text=True, env={"TSAN_OPTIONS": "halt_on_error=1", "PATH": "/usr/bin:/bin"})
    out = proc.stdout.strip()
    report = [ln for ln in proc.stderr.splitlines() if "Sanitizer" in ln or "runtime error" in ln]
    if report or (proc.returncode and not out.startswith("[FAIL]")):        # a sanitizer, or a crash
        print(f"[FAIL] {what:<10s} {rung:<20s} {m} x {n} x {k} offset {off}: exit {proc.returncode}; "
              + " | ".join(report[:3]))
        return False
    print(re.sub(r"^\[(ok  |FAIL)\] ", lambda mt: mt.group(0) + f"{what:<10s} ", out))   # the driver's verdict
    return proc.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", default=",".join(DEFAULT), help="comma-separated, from " + ",".join(LAUNCHERS))
    ap.add_argument("--quick", action="store_true", help=f"only shapes with M*N*K <= {QUICK_MAX:,}")
    ap.add_argument("--banks-only", action="store_true")
    args = ap.parse_args()
    rungs = [r for r in args.rungs.split(",") if r]
    if any(r not in LAUNCHERS for r in rungs):
        print(f"unknown rung; choose from {', '.join(LAUNCHERS)}")
        return 2
    if shutil.which("g++") is None:
        print("needs g++ (C++20: std::barrier)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "shim.h").write_text(SHIM)
        (folder / "matmul_emu.cpp").write_text(prepare(SOURCE.read_text()))
        table = ", ".join(f'{{"{r}", {fn}}}' for r, fn in LAUNCHERS.items())
        (folder / "driver.cpp").write_text(DRIVER.replace("@LAUNCHERS@", table))
        failures = 0
        print("shared-memory patterns of the warptiled kernels (from wt_place / wtc_place and the kernels' addressing):")
        asan = build(folder, "address,undefined", "emu_asan")
        failures += subprocess.run([str(asan), "banks"]).returncode != 0
        if args.banks_only:
            return 1 if failures else 0
        tsan = build(folder, "thread", "emu_tsan")
        tsan_eager = build(folder, "thread", "emu_tsan_eager", ("EMU_EAGER",))
        seed = 1
        for rung in rungs:
            for shape in SHAPES:
                small = shape[0] * shape[1] * shape[2] <= QUICK_MAX
                if rung == "naive" and not small:
                    continue
                if small or not args.quick:
                    failures += not run_case(asan, rung, shape, seed, "asan")
                if small:
                    failures += not run_case(tsan, rung, shape, seed, "tsan")
                    failures += not run_case(tsan_eager, rung, shape, seed, "tsan eager")
                seed += 1
        print("all ok" if not failures else f"{failures} failure(s)")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
