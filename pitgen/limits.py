"""Hardware and launch limits every kernel family shares (one definition each)."""

#: CUDA's limit on gridDim.y and gridDim.z.
GRID_Y_MAX = 65535
#: Largest value of the kernels' int32 indices.
INT32_MAX = 2**31 - 1
#: Threads per CTA of the index-building kernels (attention, MoE routing, SDDMM).
INDEX_THREADS = 256
#: Largest element count or index value of a host array (NumPy's intp).
INT64_MAX = 2**63 - 1
