"""The engine's own AVX512_BF16 C++ kernels for the model's layers (GEMM, fused elementwise ops),
built and loaded through ctypes; the attention kernel lives in attention/."""
