"""Low-precision training: the optimizer for bfloat16 and float16 weights."""
