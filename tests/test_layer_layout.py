"""Layer weights one array per layer (`tev_jax.models.layer_layout`, the GPU layout).

The per-layer layout must change nothing but where the weights lie: the same logits as
the scanned stack (dense and mixture targets, every parameter split except the experts'
whole stacks), the same tokens from the engine on one device and on a mesh that shards
the heads (each layer's array keeps the stack's sharding less its layer axis), and a
stack that was not split runs the scan. The GPU compiler's side (no weight copied before
its GEMM) is in tests/test_gpu_plan.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decode_fixtures import tiny_target
from tev_jax import sharding as shd
from tev_jax.decode import DecodeConfig
from tev_jax.engine import Engine
from tev_jax.models import score
from tev_jax.models import layer_layout as ll
from test_decode_mesh import CFG, PROMPTS, models  # noqa: F401  (the mesh fixture)

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


@pytest.mark.parametrize("experts", [0, 4])
def test_per_layer_logits_equal_the_scanned_stack(experts):
    target = tiny_target(layers=3, experts=experts)
    graphdef, stacked = nnx.split(target)
    split = ll.per_layer(stacked)
    flat = dict(nnx.to_flat_state(split))
    kinds = {path: ll.is_per_layer(v.get_value()) for path, v in flat.items()
             if "layers" in path}
    assert kinds and all(kinds[p] for p in kinds if "experts" not in "/".join(map(str, p)))
    if experts:  # the experts' whole stacks stay stacked (their kernel reads them in place)
        assert not all(kinds.values())
    fwd = jax.jit(lambda s, x: score(nnx.merge(graphdef, s), x))
    tokens = (jnp.arange(24).reshape(2, 12) * 7) % target.config.vocab_size
    want, got = fwd(stacked, tokens), fwd(split, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # negative control: another layer's weights in slot 0 change the logits
    swapped = jax.tree.map(lambda w: ll.PerLayer(w.arrays[1:2] + w.arrays[1:])
                           if ll.is_per_layer(w) else w, split, is_leaf=ll.is_per_layer)
    assert float(jnp.max(jnp.abs(fwd(swapped, tokens) - want))) > 1e-3


def test_per_layer_program_has_no_layer_loop():
    target = tiny_target(layers=3)
    graphdef, stacked = nnx.split(target)
    tokens = jnp.zeros((1, 4), jnp.int32)
    fwd = lambda s: score(nnx.merge(graphdef, s), tokens)  # noqa: E731
    assert "while" in jax.jit(fwd).lower(stacked).as_text()
    assert "while" not in jax.jit(fwd).lower(ll.per_layer(stacked)).as_text()


def _cfg():
    return DecodeConfig(max_new_tokens=12, budget=8, verifier="tev")


@needs8
@pytest.mark.slow
def test_engine_tokens_equal_in_both_layouts_on_one_device_and_a_mesh(models):  # noqa: F811
    target, drafter = models
    mesh = shd.make_mesh(data=2, tensor=4, fsdp=1)
    key = jax.random.key(3)
    runs = {}
    for name, m in (("one", None), ("mesh", mesh)):
        for layout in ("stacked", "per_layer"):
            engine = Engine.create(target, drafter, _cfg(), len(PROMPTS),
                                   prompt_len=8, mesh=m, layer_layout=layout)
            assert engine.layer_layout == layout
            out = engine.finish(engine.generate(engine.prompts(PROMPTS), key))
            runs[name, layout] = np.asarray(out.tokens)
    kernel = dict(nnx.to_flat_state(Engine.create(
        target, drafter, _cfg(), len(PROMPTS), prompt_len=8, mesh=mesh,
        layer_layout="per_layer").params[0]))[("layers", "self_attn", "q_proj", "kernel")]
    layer0 = kernel.get_value().arrays[0]
    assert layer0.shape == (CFG.hidden_size, CFG.num_heads, CFG.head_dim)
    assert "tensor" in str(layer0.sharding.spec)  # the heads stay split over tensor
    for run in runs.values():
        np.testing.assert_array_equal(run, runs["one", "stacked"])


def test_auto_layout_is_per_layer_on_gpus_only_and_bad_names_are_refused():
    assert ll.choose("auto", "gpu") == "per_layer" == ll.choose("auto", "cuda")
    assert ll.choose("auto", "tpu") == "stacked" == ll.choose("auto", "cpu")
    assert ll.choose("per_layer", "tpu") == "per_layer"
    target = tiny_target()
    assert Engine.create(target, None, DecodeConfig(builder="none", max_new_tokens=4), 1,
                         prompt_len=8).layer_layout == "stacked"
    with pytest.raises(ValueError, match="layer_layout must be one of"):
        Engine.create(target, None, DecodeConfig(builder="none", max_new_tokens=4), 1,
                      prompt_len=8, layer_layout="unrolled")
