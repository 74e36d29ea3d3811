// Runs the CUDA kernels of engine/src/tensor/device/cuda/matmul.cu on the host, one std::thread
// per lane of a 32-thread block (the warp shuffles meet at a barrier), so that
// engine/tests/device.rs can check their arithmetic against the CPU where there is no GPU. The
// intrinsics are the IEEE operations they name: compiled with -ffp-contract=off and no fast-math,
// `a * b` and `a + b` round once to nearest like __fmul_rn and __fadd_rn, and std::fmaf is the
// fused multiply-add of __fmaf_rn.
//
// stdin: eleven u32 (kernel index in DeviceFormat::ALL order, m, n, k, row_bytes, d_off, s_off,
// bs_off, pr_off, weight bytes, activation bytes), the weight bytes, the activation bytes.
// stdout: the m × n f32 outputs.
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
#define __restrict__
#define __launch_bounds__(n)

struct Index {
    unsigned x, y, z;
};
static thread_local Index threadIdx, blockIdx;

static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __int2float_rn(int i) { return (float)i; }
static inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// The 32 lanes of the block running now meet here (a reusable barrier, C++11).
static struct {
    std::mutex mu;
    std::condition_variable cv;
    unsigned waiting = 0, generation = 0;
    void wait() {
        std::unique_lock<std::mutex> lock(mu);
        unsigned gen = generation;
        if (++waiting == 32u) {
            waiting = 0;
            generation++;
            cv.notify_all();
        } else {
            cv.wait(lock, [&] { return generation != gen; });
        }
    }
} warp_barrier;
static float warp_slots[32];
static float exchange(float v, unsigned from) {
    warp_slots[threadIdx.x] = v;
    warp_barrier.wait();
    float r = warp_slots[from];
    warp_barrier.wait();
    return r;
}
static inline float __shfl_sync(unsigned, float v, unsigned src) { return exchange(v, src % 32u); }
static inline float __shfl_down_sync(unsigned, float v, unsigned d) {
    unsigned src = threadIdx.x + d;
    return exchange(v, src < 32u ? src : threadIdx.x);
}

#include "../../src/tensor/device/cuda/matmul.cu"

typedef void (*Kernel)(const unsigned char*, const u32*, float*, u32, u32, u32, u32, u32, u32,
                       u32, u32);
static const Kernel KERNELS[9] = {matmul_f32,  matmul_bf16, matmul_f16, matmul_mxfp4, matmul_q8_0,
                                  matmul_q4_0, matmul_q4_1, matmul_q4_k, matmul_q6_k};

int main() {
    u32 h[11];
    if (fread(h, 4, 11, stdin) != 11 || h[0] > 8) return 2;
    std::vector<unsigned char> w(h[9] + 4), xs(h[10] + 4);
    if (fread(w.data(), 1, h[9], stdin) != h[9] || fread(xs.data(), 1, h[10], stdin) != h[10])
        return 2;
    u32 m = h[1], n = h[2];
    std::vector<float> y((size_t)m * n, -1.0f);
    bool floats = h[0] <= 3;
    u32 groups = floats ? n : (n + 3) / 4;
    for (u32 g = 0; g < groups; g++) {
        std::vector<std::thread> lanes;
        for (u32 l = 0; l < 32; l++) {
            lanes.emplace_back([&, l] {
                threadIdx = {l, 0, 0};
                blockIdx = {g, 0, 0};
                KERNELS[h[0]](w.data(), (const u32*)xs.data(), y.data(), m, n, h[3], h[4], h[5],
                              h[6], h[7], h[8]);
            });
        }
        for (auto& t : lanes) t.join();
    }
    fwrite(y.data(), 4, y.size(), stdout);
    return 0;
}
