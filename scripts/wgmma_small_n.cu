// Throughput of small-N wgmma on Hopper: is a row-owner GEMM that keeps its accumulators in
// registers, one m64 x n8 group per 8 output rows of C^T and a product only for the groups
// active in a k-tile, worth building? (performance.md, "Session 68"). One CTA per SM, two
// warpgroups, operands in shared memory (contents do not matter for the rate):
//   n8 RS x32   wgmma m64n8k16, A from registers, 32 accumulator groups a warpgroup, all issued
//   n8 RS pred  the same, each under a warp-uniform predicate (57% of the groups active):
//               ptxas serializes wgmma in a divergent path (C7520)
//   n64 SS x4   wgmma m64n64k16 from shared memory: the dense rate
// Build and run on an sm_90 GPU:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/wgmma_small_n scripts/wgmma_small_n.cu
//   /tmp/wgmma_small_n
#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
// The descriptors are formed inside the asm (base + immediate offset): 128 hoisted 64-bit
// descriptors would take every register and serialize the pipeline for want of them.
template <int OFF, bool PRED>
__device__ __forceinline__ void mma_n8(float (&d)[4], const uint32_t (&a)[4], uint64_t db,
                                       uint32_t on) {
    if constexpr (PRED) {
        asm volatile("{\n.reg .b64 dd;\n.reg .pred q;\nadd.s64 dd, %8, %9;\nsetp.ne.b32 q, %10, 0;\n"
                     "@q wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, dd, 1, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(OFF), "r"(on)
                     : "memory");
    } else {
        asm volatile("{\n.reg .b64 dd;\nadd.s64 dd, %8, %9;\n"
                     "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, dd, 1, 1, 1, 0;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(OFF) : "memory");
    }
}
template <int G, bool PRED>
__device__ __forceinline__ void groups(float (&acc)[32][4], const uint32_t (&a)[4], uint64_t d0,
                                       uint32_t bits) {
    if constexpr (G < 32) {
        mma_n8<G * 64, PRED>(acc[G], a, d0, (bits >> G) & 1u);   // 8 rows x 128 B: 1 KB apart
        groups<G + 1, PRED>(acc, a, d0, bits);
    }
}
template <int OFF>
__device__ __forceinline__ void mma_n64(float (&d)[32], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .b64 dd;\nadd.s64 dd, %33, %34;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, dd, 1, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "n"(OFF) : "memory");
}
template <int G>
__device__ __forceinline__ void groups64(float (&acc)[4][32], uint64_t da, uint64_t d0) {
    if constexpr (G < 4) {
        mma_n64<G * 512>(acc[G], da, d0);   // 64 rows x 128 B: 8 KB apart
        groups64<G + 1>(acc, da, d0);
    }
}
__device__ __forceinline__ uint64_t tile_desc(const void* tile) {   // 128-byte swizzle, K-major
    const uint32_t addr = smem_addr(tile);
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)64 << 32)
           | (1ull << 62);
}

// The descriptor of the first 1024-byte-aligned tile of dynamic shared memory (the same in
// every kernel here: none has static shared memory), passed to the kernels as a parameter so
// that it sits in a uniform register, as a GEMM's does (formed per thread, ptxas serialized
// the pipeline for want of registers, C7511).
__global__ void first_tile(uint64_t* desc) {
    extern __shared__ __align__(1024) unsigned char raw[];
    *desc = tile_desc(raw + ((1024 - (smem_addr(raw) & 1023)) & 1023));
}

// n8 groups (PRED: each under a warp-uniform predicate, bit g of masks[t % 256])
template <bool PRED>
__global__ void __launch_bounds__(256, 1) rate_n8(int ktiles, const uint32_t* masks, float* out,
                                                  uint64_t d0) {
    float acc[32][4];
    for (int g = 0; g < 32; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
    uint32_t a[4][4];
    for (int kk = 0; kk < 4; ++kk)
        for (int x = 0; x < 4; ++x) a[kk][x] = threadIdx.x + kk * 7 + x;
    for (int t = 0; t < ktiles; ++t) {
        const uint32_t bits = PRED ? masks[t & 255] : 0u;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < 4; ++kk) groups<0, PRED>(acc, a[kk], d0 + kk * 2, bits);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float s = 0.f;
    for (int g = 0; g < 32; ++g) s += acc[g][0] + acc[g][1] + acc[g][2] + acc[g][3];
    out[threadIdx.x] = s;
}

__global__ void __launch_bounds__(256, 1) rate_n64(int ktiles, float* out, uint64_t d0) {
    float acc[4][32];
    for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 32; ++i) acc[g][i] = 0.f;
    const uint64_t da = d0 + (64 * 1024 >> 4);
    for (int t = 0; t < ktiles; ++t) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        #pragma unroll
        for (int kk = 0; kk < 4; ++kk) groups64<0>(acc, da + kk * 2, d0 + kk * 2);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    float s = 0.f;
    for (int g = 0; g < 4; ++g)
        for (int i = 0; i < 32; ++i) s += acc[g][i];
    out[threadIdx.x] = s;
}

int main() {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    const int ktiles = 4096, smem = 100 * 1024;
    float* out;
    uint32_t* masks;
    cudaMalloc(&out, sms * 256 * sizeof(float));
    cudaMalloc(&masks, 256 * sizeof(uint32_t));
    uint32_t host[256], state = 12345u;
    long long active = 0;
    for (int i = 0; i < 256; ++i) {   // each group active with probability 0.57
        host[i] = 0;
        for (int g = 0; g < 32; ++g) {
            state = state * 1664525u + 1013904223u;
            if ((state >> 8) % 100 < 57) host[i] |= 1u << g;
        }
        active += __builtin_popcount(host[i]);
    }
    cudaMemcpy(masks, host, sizeof(host), cudaMemcpyHostToDevice);
    uint64_t d0, *dd;
    cudaMalloc(&dd, sizeof(d0));
    cudaFuncSetAttribute(first_tile, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    first_tile<<<1, 1, smem>>>(dd);
    cudaMemcpy(&d0, dd, sizeof(d0), cudaMemcpyDeviceToHost);
    cudaFuncSetAttribute(rate_n8<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(rate_n8<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaFuncSetAttribute(rate_n64, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const char* names[] = {"n8 RS x32", "n8 RS pred", "n64 SS x4"};
    for (int mode = 0; mode < 3; ++mode) {
        auto go = [&]() {
            if (mode == 0) rate_n8<false><<<sms, 256, smem>>>(ktiles, masks, out, d0);
            else if (mode == 1) rate_n8<true><<<sms, 256, smem>>>(ktiles, masks, out, d0);
            else rate_n64<<<sms, 256, smem>>>(ktiles, out, d0);
        };
        go();
        cudaDeviceSynchronize();
        float best = 1e30f;
        for (int r = 0; r < 5; ++r) {
            cudaEventRecord(e0);
            go();
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms;
            cudaEventElapsedTime(&ms, e0, e1);
            best = ms < best ? ms : best;
        }
        // multiply-adds issued: CTAs x 2 warpgroups x k-tiles x 4 k-steps x the groups' products
        const double share = mode == 1 ? active / (256.0 * 32) : 1.0;
        const double per_step = mode < 2 ? 32 * share * 64 * 8 * 16 : 4.0 * 64 * 64 * 16;
        const double macs = (double)sms * 2 * ktiles * 4 * per_step;
        printf("%-11s %7.3f ms  %6.1f TFLOP/s issued%s\n", names[mode], best, 2 * macs / best / 1e9,
               cudaGetLastError() == cudaSuccess ? "" : " (error)");
    }
    return 0;
}
