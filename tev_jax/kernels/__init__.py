"""Pallas kernels, one module per operation, apart from the models (docs/design.md,
"Code style").

Each module holds the operation's TPU and GPU kernels (where there are), the plain-jnp
reference the tests compare them against, its cost estimate, and, where a kernel
chooses block sizes, a small table of them per GPU (H100 / H200 / B200) read at trace
time. The models call one function per operation and never know which platform's
kernel ran:

- `tev_jax.kernels.cache_attention`: a few queries against one layer of the stacked KV
  cache (`cache_attention_state`, joined by `merge_states`): TPU (Mosaic) and GPU
  (Triton) kernels;
- `tev_jax.kernels.stacked_matmul`: ``x · w[g]`` for one entry of a stacked weight,
  read in place (`stacked_dot`): a GPU (Triton) kernel; TPU's compiler does it itself;
- `tev_jax.kernels.expert_kernel`: grouped SwiGLU experts over (token, expert) pairs
  sorted by expert, summed per token (`expert_sum`): TPU (Mosaic) kernels, one with the
  tokens in VMEM; ``ragged_dot`` elsewhere;
- `tev_jax.kernels.gpu_table`: the lookup of a kernel's per-GPU block table.

Kernels import nothing from `tev_jax.models`.
"""
