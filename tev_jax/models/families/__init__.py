"""The target families shipped with tev-jax, one file each; importing this package
registers them (`tev_jax.models.registry`):

- `tev_jax.models.families.qwen3`: Qwen3, Llama-3 and Qwen3-MoE (one Qwen3-style block);
- `tev_jax.models.families.gemma4`: Gemma 4 (sliding + global layers, sandwich norms).

`tev_jax.models` imports this package, so every family is registered whenever the
models are.
"""

# registration order is the order error messages list the model types in
from tev_jax.models.families import qwen3  # noqa: I001
from tev_jax.models.families import gemma4

__all__ = ["gemma4", "qwen3"]
