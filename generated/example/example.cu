// Runs every kernel of pitgen's catalogue (../pit_*.h) on the GPU and checks it against a
// float64 CPU reference: random operands; masks at the kernel's granularity, element by
// element, empty and full; odd extents and misaligned pointers (the narrow variants); a short K
// (direct row stores). The output is poisoned with NaN before every run, so an element a
// kernel forgets to write shows up. Then the argument checks, then timings.
// Exit status: 0 when every check passes, 1 on a mismatch (rel. error > 1e-2), 2 on a CUDA error.
//
// Build and run with nvcc alone: make run [ARCH=sm_90 | ARCH=sm_90a: the Hopper kernels too];
// `example --no-timing` only checks.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "pit_matmul_a_bf16_block64x64_sm80.h"
#include "pit_matmul_a_bf16_k32x1_sm80.h"
#include "pit_matmul_a_bf16_m1x64_sm80.h"
#include "pit_matmul_a_f16_block64x64_sm80.h"
#include "pit_matmul_a_f16_k32x1_sm80.h"
#include "pit_matmul_a_f16_m1x64_sm80.h"
#ifdef PITGEN_EXAMPLE_SM90A  // built with ARCH=sm_90a: the Hopper kernels too
#include "pit_matmul_a_bf16_block128x128_sm90a.h"
#include "pit_matmul_a_f16_block128x128_sm90a.h"
#endif

#define CUDA_CHECK(call)                                                                  \
    do {                                                                                  \
        const cudaError_t e_ = (call);                                                    \
        if (e_ != cudaSuccess) {                                                          \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,            \
                         cudaGetErrorString(e_));                                         \
            std::exit(2);                                                                 \
        }                                                                                 \
    } while (0)

namespace {

constexpr double TOLERANCE = 1e-2;

using WorkspaceSize = cudaError_t (*)(int64_t, int64_t, int64_t, size_t*);
using BuildIndex = cudaError_t (*)(const void*, int64_t, int64_t, int64_t, void*, size_t, cudaStream_t);
using Run = cudaError_t (*)(const void*, const void*, void*, int64_t, int64_t, int64_t, void*, size_t,
                            cudaStream_t);
using Message = const char* (*)(void);

// One catalogue kernel for C[m,n] = A[m,k] * B[k,n], A sparse in tile_m x tile_k units.
struct Kernel {
    const char* name;
    int dtype, tile_m, tile_k;
    WorkspaceSize workspace_size;
    BuildIndex build_index;
    Run run, build_and_run;
    Message error_message;
};

#define KERNEL(n)                                                                                \
    Kernel { #n, n##_dtype, n##_tile_m, n##_tile_k, n##_workspace_size, n##_build_index, n##_run, \
             n##_build_and_run, n##_error_message }

const Kernel KERNELS[] = {
    KERNEL(pit_matmul_a_f16_k32x1_sm80),  KERNEL(pit_matmul_a_f16_m1x64_sm80),
    KERNEL(pit_matmul_a_f16_block64x64_sm80), KERNEL(pit_matmul_a_bf16_k32x1_sm80),
    KERNEL(pit_matmul_a_bf16_m1x64_sm80), KERNEL(pit_matmul_a_bf16_block64x64_sm80),
#ifdef PITGEN_EXAMPLE_SM90A
    KERNEL(pit_matmul_a_f16_block128x128_sm90a), KERNEL(pit_matmul_a_bf16_block128x128_sm90a),
#endif
};

enum class Mask { Tiles, Elements, Empty, Full };

struct Case {
    const char* label;
    int M, N, K;
    Mask mask;
    double density;  // of non-zero tiles (Tiles) or elements (Elements)
    int offset;      // elements added to every operand pointer: 1 leaves them 2-byte aligned only
    bool split;      // build_index and run as two calls (else build_and_run)
};

const Case CASES[] = {
    {"tiles", 512, 384, 768, Mask::Tiles, 0.25, 0, false},
    {"elements", 333, 197, 517, Mask::Elements, 0.05, 0, true},
    {"offset", 256, 264, 320, Mask::Tiles, 0.3, 1, false},
    {"short-k", 200, 136, 48, Mask::Tiles, 0.5, 0, true},
    {"empty", 128, 96, 160, Mask::Empty, 0.0, 0, false},
    {"full", 192, 64, 320, Mask::Full, 1.0, 0, false},
};

// xorshift64*: fast and reproducible.
struct Rng {
    uint64_t s;
    double uniform()
    {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        return (double)((s * 2685821657736338717ull) >> 11) * (1.0 / 9007199254740992.0);
    }
};

size_t elem_size(int dtype) { return dtype == PITGEN_FLOAT32 ? 4 : 2; }

// The value the device will see: x rounded to the kernel's element type.
float round_to(float x, int dtype)
{
    if (dtype == PITGEN_FLOAT16) return __half2float(__float2half_rn(x));
    if (dtype == PITGEN_BFLOAT16) return __bfloat162float(__float2bfloat16_rn(x));
    return x;
}

std::vector<unsigned char> encode(const std::vector<float>& v, int dtype)
{
    std::vector<unsigned char> out(v.size() * elem_size(dtype));
    for (size_t i = 0; i < v.size(); ++i) {
        if (dtype == PITGEN_FLOAT16) {
            const __half h = __float2half_rn(v[i]);
            std::memcpy(&out[2 * i], &h, 2);
        } else if (dtype == PITGEN_BFLOAT16) {
            const __nv_bfloat16 h = __float2bfloat16_rn(v[i]);
            std::memcpy(&out[2 * i], &h, 2);
        } else {
            std::memcpy(&out[4 * i], &v[i], 4);
        }
    }
    return out;
}

double decode(const unsigned char* p, int dtype)
{
    if (dtype == PITGEN_FLOAT16) {
        __half h;
        std::memcpy(&h, p, 2);
        return __half2float(h);
    }
    if (dtype == PITGEN_BFLOAT16) {
        __nv_bfloat16 h;
        std::memcpy(&h, p, 2);
        return __bfloat162float(h);
    }
    float f;
    std::memcpy(&f, p, 4);
    return f;
}

// A[M,K] with the mask applied; values already rounded to the element type.
std::vector<float> sparse_operand(const Kernel& k, const Case& c, Rng& rng)
{
    const int gm = (c.M + k.tile_m - 1) / k.tile_m, gk = (c.K + k.tile_k - 1) / k.tile_k;
    std::vector<char> tiles((size_t)gm * gk);
    for (auto& t : tiles) t = rng.uniform() < c.density;
    std::vector<float> a((size_t)c.M * c.K);
    for (int i = 0; i < c.M; ++i)
        for (int j = 0; j < c.K; ++j) {
            bool keep = c.mask == Mask::Full;
            if (c.mask == Mask::Tiles) keep = tiles[(size_t)(i / k.tile_m) * gk + j / k.tile_k];
            if (c.mask == Mask::Elements) keep = rng.uniform() < c.density;
            a[(size_t)i * c.K + j] = keep ? round_to((float)(2 * rng.uniform() - 1), k.dtype) : 0.0f;
        }
    return a;
}

std::vector<float> dense_operand(size_t n, int dtype, Rng& rng)
{
    std::vector<float> b(n);
    for (auto& x : b) x = round_to((float)(2 * rng.uniform() - 1), dtype);
    return b;
}

// Device copies of A, B and room for C, each `offset` elements past a cudaMalloc'd pointer.
struct Buffers {
    unsigned char *a = nullptr, *b = nullptr, *c = nullptr, *ws = nullptr;
    size_t ws_bytes = 0;
    void* at(unsigned char* base, int offset, int dtype) const { return base + offset * elem_size(dtype); }
    ~Buffers()
    {
        cudaFree(a);
        cudaFree(b);
        cudaFree(c);
        cudaFree(ws);
    }
};

void upload(const Kernel& k, const Case& c, const std::vector<float>& a, const std::vector<float>& b,
            Buffers& d)
{
    const size_t es = elem_size(k.dtype), pad = c.offset * es;
    const auto ha = encode(a, k.dtype), hb = encode(b, k.dtype);
    CUDA_CHECK(cudaMalloc(&d.a, ha.size() + pad));
    CUDA_CHECK(cudaMalloc(&d.b, hb.size() + pad));
    CUDA_CHECK(cudaMalloc(&d.c, (size_t)c.M * c.N * es + pad));
    CUDA_CHECK(cudaMemcpy(d.a + pad, ha.data(), ha.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d.b + pad, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(k.workspace_size(c.M, c.N, c.K, &d.ws_bytes));
    CUDA_CHECK(cudaMalloc(&d.ws, d.ws_bytes));
}

// ||C - ref|| / ||ref|| (||C|| when ref is 0): NaN when C holds a NaN.
double relative_error(const std::vector<unsigned char>& c, const std::vector<float>& a,
                      const std::vector<float>& b, const Case& cs, int dtype)
{
    std::vector<double> ref((size_t)cs.M * cs.N, 0.0);
    for (int i = 0; i < cs.M; ++i)
        for (int k = 0; k < cs.K; ++k) {
            const double x = a[(size_t)i * cs.K + k];
            if (x == 0.0) continue;
            const float* brow = &b[(size_t)k * cs.N];
            double* crow = &ref[(size_t)i * cs.N];
            for (int j = 0; j < cs.N; ++j) crow[j] += x * brow[j];
        }
    double diff = 0.0, norm = 0.0;
    for (size_t e = 0; e < ref.size(); ++e) {
        const double got = decode(&c[e * elem_size(dtype)], dtype);
        diff += (got - ref[e]) * (got - ref[e]);
        norm += ref[e] * ref[e];
    }
    return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

bool check_case(const Kernel& k, const Case& c, cudaStream_t stream, uint64_t seed)
{
    Rng rng{seed};
    const auto a = sparse_operand(k, c, rng);
    const auto b = dense_operand((size_t)c.K * c.N, k.dtype, rng);
    Buffers d;
    upload(k, c, a, b, d);
    void *pa = d.at(d.a, c.offset, k.dtype), *pb = d.at(d.b, c.offset, k.dtype), *pc = d.at(d.c, c.offset, k.dtype);
    const size_t c_bytes = (size_t)c.M * c.N * elem_size(k.dtype);
    CUDA_CHECK(cudaMemsetAsync(pc, 0xff, c_bytes, stream));  // NaN in every element
    if (c.split) {
        CUDA_CHECK(k.build_index(pa, c.M, c.N, c.K, d.ws, d.ws_bytes, stream));
        CUDA_CHECK(k.run(pa, pb, pc, c.M, c.N, c.K, d.ws, d.ws_bytes, stream));
    } else {
        CUDA_CHECK(k.build_and_run(pa, pb, pc, c.M, c.N, c.K, d.ws, d.ws_bytes, stream));
    }
    std::vector<unsigned char> got(c_bytes);
    CUDA_CHECK(cudaMemcpyAsync(got.data(), pc, c_bytes, cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const double err = relative_error(got, a, b, c, k.dtype);
    const bool ok = err <= TOLERANCE;  // false for NaN
    std::printf("%-37s %-9s %4dx%4dx%4d%s  rel err %.2e  %s\n", k.name, c.label, c.M, c.N, c.K,
                c.offset ? "+1" : "  ", err, ok ? "ok" : "MISMATCH");
    return ok;
}

// Unusable arguments must be refused with cudaErrorInvalidValue and a reason, launching nothing.
bool check_arguments(const Kernel& k, cudaStream_t stream)
{
    const int M = 128, N = 64, K = 96;
    const Case c{"args", M, N, K, Mask::Full, 1.0, 0, false};
    Rng rng{1};
    Buffers d;
    upload(k, c, sparse_operand(k, c, rng), dense_operand((size_t)K * N, k.dtype, rng), d);
    size_t bytes = 0;
    int refused = 0;
    const char* example = "";
    auto expect = [&](const char* what, cudaError_t got) {  // called right after the call it checks
        const char* why = k.error_message();
        if (got == cudaErrorInvalidValue && why[0]) {
            example = refused++ ? example : why;
        } else {
            std::printf("%-37s args      %s: expected cudaErrorInvalidValue and a reason, got %s\n", k.name,
                        what, cudaGetErrorString(got));
        }
    };
    expect("null C", k.build_and_run(d.a, d.b, nullptr, M, N, K, d.ws, d.ws_bytes, stream));
    expect("odd-byte A", k.build_and_run(d.a + 1, d.b, d.c, M, N, K, d.ws, d.ws_bytes, stream));
    expect("small workspace", k.build_and_run(d.a, d.b, d.c, M, N, K, d.ws, d.ws_bytes - 1, stream));
    expect("C overlapping A", k.build_and_run(d.a, d.b, d.a, M, N, K, d.ws, d.ws_bytes, stream));
    expect("m = 0", k.workspace_size(0, N, K, &bytes));
    expect("m*k >= 2^31", k.workspace_size(1 << 16, N, 1 << 15, &bytes));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const bool ok = refused == 6;
    std::printf("%-37s args      %d/6 refused  %s (e.g. \"%s\")\n", k.name, refused, ok ? "ok" : "MISMATCH", example);
    return ok;
}

// Mean time of build_and_run at 4096^3 with 10% of A's tiles non-zero.
void time_kernel(const Kernel& k, cudaStream_t stream)
{
    const Case c{"time", 4096, 4096, 4096, Mask::Tiles, 0.1, 0, false};
    Rng rng{7};
    Buffers d;
    upload(k, c, sparse_operand(k, c, rng), dense_operand((size_t)c.K * c.N, k.dtype, rng), d);
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    const int reps = 20;
    CUDA_CHECK(k.build_and_run(d.a, d.b, d.c, c.M, c.N, c.K, d.ws, d.ws_bytes, stream));  // warm-up
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < reps; ++i)
        CUDA_CHECK(k.build_and_run(d.a, d.b, d.c, c.M, c.N, c.K, d.ws, d.ws_bytes, stream));
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const double us = 1000.0 * ms / reps;
    std::printf("%-37s time      %dx%dx%d, 10%% of tiles: %8.1f us per build_and_run (%.1f dense-equivalent TFLOP/s)\n",
                k.name, c.M, c.N, c.K, us, 2.0 * c.M * c.N * c.K / (us * 1e6));
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
}

}  // namespace

int main(int argc, char** argv)
{
    const bool timing = !(argc > 1 && std::strcmp(argv[1], "--no-timing") == 0);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int failures = 0;
    uint64_t seed = 12345;
    for (const Kernel& k : KERNELS) {
        for (const Case& c : CASES) failures += !check_case(k, c, stream, ++seed);
        failures += !check_arguments(k, stream);
    }
    if (timing)
        for (const Kernel& k : KERNELS) time_kernel(k, stream);
    CUDA_CHECK(cudaStreamDestroy(stream));
    CUDA_CHECK(cudaDeviceSynchronize());
    std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
