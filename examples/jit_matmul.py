"""GPU: a dynamically sparse matmul on PyTorch tensors, compiled on the fly. A is 90% sparse in
32x1 micro-tiles; the index of its non-zero micro-tiles is built on the GPU at every call.
Needs a CUDA device, torch and pycuda (``pip install 'pitgen[cuda,torch]'``).

    python examples/jit_matmul.py
"""
import sys

try:
    import pycuda.driver  # noqa: F401
    import torch
except ImportError as e:
    sys.exit(f"jit_matmul.py needs torch and pycuda (pip install 'pitgen[cuda,torch]'): {e}")
if not torch.cuda.is_available():
    sys.exit("jit_matmul.py needs a CUDA device: torch sees none")

import pitgen  # noqa: E402

A = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
A *= (torch.rand(4096 // 32, 4096, device="cuda") < 0.1).repeat_interleave(32, 0)
B = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

k = pitgen.compile("C[m,n] += A[m,k] * B[k,n]", sparse="A", dtype="float16", micro_tile="auto")
C = k(A, B)                     # index built on the GPU, then the tile kernel; no host sync
print("plan:", k.plan.choice.label)   # chosen on the first call from counts reduced on the GPU
k(A, B, out=C, accumulate=True)       # C += A @ B
ref = 2 * (A.float() @ B.float())
err = ((C.float() - ref).norm() / ref.norm()).item()
print(f"relative error vs torch (fp32): {err:.1e}")
sys.exit(0 if err < 1e-2 else 1)
