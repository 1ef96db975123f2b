"""The fused kernels of a decoding step, for a few rows at a time: a norm or an activation with
the projection after it (norm_matmul), and a Mamba block's step with its out-projection
(step_out). They bound a one-token step's latency, which at batch 1 is its kernel count."""
