"""The benchmarks: one shared harness and one script per table, each run on a GPU from the
repository root as `python3 -m bench.<script>` (its docstring says what it measures and how).

    harness       timing, the copy-bandwidth floor, kernel checks, child processes, tables
    baseline      mamba_ssm from a git-ignored copy, the path it runs, the ratio guard
    generate      decoding: mamba_jax.generate against mamba_ssm's generate(cg=True)
    train_step    the trainer's step: meshes, throughput, longest sequence, against mamba_ssm
    ssd           the SSD scan's kernels against mamba_ssm's Triton kernels
    step          the decode step's SSM kernel against our XLA path, per tile setting
    norm_matmul   the norm-then-projection kernel against our XLA path, per tile setting
    profile_step  where the GPU time of a train step (or a decode step) goes
    dispatch      generate()'s cost a call on the host
"""
