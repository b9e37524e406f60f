"""PyTorch modules, drop-ins for their dense counterparts (same parameters and state_dict layout):
``SparseLinear`` (nn.Linear with a dynamic weight mask or sparse inputs), ``SparseAttention``
(nn.MultiheadAttention over a dynamic mask), ``MoE`` (a routed expert FFN block), and
``RGCNConv`` (a relational graph convolution, inference only), ``SAGEConv`` and ``GraphSAGE``
(GraphSAGE, trainable: pitgen's graph SpMM with autograd), and ``SparseConv2d`` (nn.Conv2d
skipping the input's all-zero channels; cuDNN's backward).

Resolved on first use, so ``import pitgen`` needs no torch."""
from __future__ import annotations

import importlib
from typing import Any

_HOME = {"SparseLinear": "pitgen.ops.linear", "SparseAttention": "pitgen.ops.attention",
         "MoE": "pitgen.ops.moe", "RGCNConv": "pitgen.ops.rgcn", "SAGEConv": "pitgen.ops.sage",
         "GraphSAGE": "pitgen.ops.sage", "SparseConv2d": "pitgen.ops.conv"}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pitgen.nn' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
