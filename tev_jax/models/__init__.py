"""Models: the target decoder (Qwen3 / Llama-3) and its building blocks.

Entry points: `load_target`, `save_target`, `score`, `load_tokenizer`, `init_target`.
See `tev_jax.models.target` for the cached forward modes and the functional (split /
merge) pattern to use in jitted loops.
"""

from tev_jax.models.checkpoint_io import load_target, load_tokenizer, save_target
from tev_jax.models.config import ModelConfig, RopeScaling
from tev_jax.models.kv_cache import KVCache, commit, init_cache
from tev_jax.models.target import Target, init_target, score

__all__ = [
    "KVCache", "ModelConfig", "RopeScaling", "Target", "commit", "init_cache",
    "init_target", "load_target", "load_tokenizer", "save_target", "score",
]
