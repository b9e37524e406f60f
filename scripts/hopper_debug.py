import sys, torch, pitgen
from pitgen import runtime
from pitgen.ops import matmul as mm
EXPR = "C[m,n] += A[m,k] * B[k,n]"
variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
orig_load = runtime.load
def patched(source, sigs):
    if variant == "noreg":
        source = source.replace("sm90::regs_dec<PRODUCER_REGS>();", "").replace("sm90::regs_inc<CONSUMER_REGS>();", "")
    if variant == "entry":
        source = source.replace("#include <cuda.h>", "#include <cuda.h>\n#include <cstdio>")
        source = source.replace("    extern __shared__ __align__(16) unsigned char smem_raw[];\n    unsigned char* smem =",
            '    if (threadIdx.x == 0 && blockIdx.x == 0) printf("entry M %d N %d K %d sa %d %d sb %d %d sc %d %d tk %d a %p c %p\\n", M, N, K, sa_m, sa_k, sb_k, sb_n, sc_m, sc_n, tk, a, c);\n    extern __shared__ __align__(16) unsigned char smem_raw[];\n    unsigned char* smem =', 1)
        assert "entry M" in source
    if variant == "printf":
        source = source.replace("// Epilogue: every accumulator", 'if ((tid & 127) == 0 && t == blockIdx.x) printf("cta %d wg %d tile %d iters %d acc0 %f\\n", blockIdx.x, wg, t, iters, acc[0]);\n// Epilogue')
        source = source.replace("#include <cuda.h>", "#include <cuda.h>\n#include <cstdio>")
    return orig_load(source, sigs)
mm.MATMUL.module.__func__ if False else None
import pitgen.opspec as ops
ops.load = patched
for micro, M in (("dense", 256), ("128x128", 256), ("64x1", 128)):
    a = torch.randn(M, M, device="cuda", dtype=torch.float16)
    b = torch.randn(M, M, device="cuda", dtype=torch.float16)
    out = torch.full((M, M), float("nan"), device="cuda", dtype=torch.float16)
    k = pitgen.compile(EXPR, sparse="A", micro_tile=micro, vendor_dense=False)
    call = k.prepare(a, b, out=out)
    print(variant, micro, call.L.spec.gemm, call.L.geo.grid, call.L.smem, flush=True)
    try:
        k(a, b, out=out)
        runtime._drv().Context.synchronize()
        torch.cuda.synchronize()
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True); break
    ref = a.double() @ b.double()
    print(" nonfinite", int((~torch.isfinite(out)).sum()), "err", ((out.double() - ref).norm() / ref.norm()).item(), flush=True)
