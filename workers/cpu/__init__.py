"""CPU speed: fused and exact torch paths, the C++ kernels (native/) with their build, and pinned host memory."""
