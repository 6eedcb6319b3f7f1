"""Quantization: the packed format, the layers that hold it (and the kernels' dot-product layers), and the swap that
turns a built model's linears and embedding into them."""
