"""Models: the target decoder (Qwen3 / Llama-3 / Qwen3-MoE / Gemma 4) and its building
blocks.

Entry points: `load_target`, `save_target`, `score`, `load_tokenizer`, `init_target`.
See `tev_jax.models.target` for the cached forward modes and the functional (split /
merge) pattern to use in jitted loops.
"""

# Every family registers itself (`tev_jax.models.registry`) before anything builds a model.
from tev_jax.models import families  # noqa: F401  (registers qwen3, llama, qwen3_moe, gemma4)
from tev_jax.models.checkpoint_io import load_target, load_tokenizer, save_target
from tev_jax.models.config import AttentionSpec, LayerSpec, ModelConfig, RopeScaling
from tev_jax.models.kv_cache import KVCache, commit, init_cache
from tev_jax.models.target import Target, init_target, score

__all__ = [
    "AttentionSpec", "KVCache", "LayerSpec", "ModelConfig", "RopeScaling", "Target", "commit", "init_cache",
    "init_target", "load_target", "load_tokenizer", "save_target", "score",
]

# The DFlash drafter (`tev_jax.models.drafter`, checkpoints in `drafter_io`).
from tev_jax.models.drafter import Drafter, DrafterCache, DrafterConfig  # noqa: E402
from tev_jax.models.drafter_io import init_drafter, load_drafter, save_drafter  # noqa: E402

__all__ += ["Drafter", "DrafterCache", "DrafterConfig", "init_drafter", "load_drafter",
            "save_drafter"]

# The demo models shipped inside the package (`tev_jax.models.bundled`).
from tev_jax.models.bundled import bundled_paths, load_bundled  # noqa: E402

__all__ += ["bundled_paths", "load_bundled"]
