"""Weight quantisation of the linear layers: FP8 (fp8.py: the configuration read from a
checkpoint or --quantization; fp8_linear.py: parameters, loading and the matmul)."""
