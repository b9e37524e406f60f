"""One launch of every kernel kind (index build, tile kernel, SWrite passes), for
``compute-sanitizer --tool memcheck|racecheck python scripts/sanitize_launches.py``."""
import torch

import pitgen

M, N, K = 200, 136, 300  # not tile multiples
for dtype in ("float16", "float32"):
    A = torch.randn(M, K, device="cuda", dtype=getattr(torch, dtype))
    A = A * (torch.rand(M, K, device="cuda") < 0.2).to(A.dtype)
    B = torch.randn(K, N, device="cuda", dtype=A.dtype)
    ref = A.double() @ B.double()
    for micro in ("dense", "32x1", "1x64", "1x512", "32x32"):
        out = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=dtype, micro_tile=micro)(A, B)
        torch.cuda.synchronize()
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"{dtype} {micro}: relative error {err:.2e}")
        assert err < 1e-2
    Bs = B * (torch.rand(K, N, device="cuda") < 0.2).to(B.dtype)
    out = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="B", dtype=dtype, micro_tile="1x32")(A, Bs)
    torch.cuda.synchronize()
    print(f"{dtype} sparse B 1x32: ok")
    mask = A != 0  # the index built from a byte mask instead of the values
    for micro in ("32x1", "1x64", "32x32"):
        pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype=dtype, micro_tile=micro)(A, B, mask=mask)
    torch.cuda.synchronize()
    print(f"{dtype} masked index: ok")
