"""CPU only: derive the PIT rules of a matmul, plan a 95%-sparse operand from its mask, run the
plan's steps (SRead -> dense tiles -> SWrite) in NumPy and check them against A @ B.

    python examples/rules_and_plan.py
"""
import numpy as np

import pitgen

EXPR = "C[m,n] += A[m,k] * B[k,n]"

# 1. Rules: which axes may be permuted, and what that needs at run time (SRead, SWrite).
print(pitgen.analyse(EXPR).explain())

# 2. Plan: A is 95% sparse in 32x1 micro-tiles (extent 1 along the reduction axis k).
rng = np.random.default_rng(0)
mask = np.kron(rng.random((64, 1024)) < 0.05, np.ones((32, 1), bool))
A = rng.standard_normal((2048, 1024)).astype(np.float32) * mask
B = rng.standard_normal((1024, 256)).astype(np.float32)
plan = pitgen.plan(EXPR, sparse="A", mask=mask)
print(plan.table())

# 3. Execute the plan on the CPU exactly as a kernel would, and check it.
C = pitgen.execute(plan, A=A, B=B)
err = np.abs(C - A.astype(np.float64) @ B).max()
assert err < 1e-3, err
print(f"choice: {plan.choice.label} (waste {plan.choice.waste:.2f}); max error vs NumPy {err:.1e}")
