"""`tev_jax.kernels.gpu_table`: which entry of a per-GPU block table a device gets."""

import jax
import pytest

from tev_jax.kernels import cache_attention, gpu_table, stacked_matmul


def test_lookup_matches_the_device_kind_and_falls_back_to_the_default():
    table = {"H100": "h100 blocks", "H200": "h200 blocks", "B200": "b200 blocks"}
    assert gpu_table.lookup(table, "NVIDIA H200") == "h200 blocks"
    assert gpu_table.lookup(table, "NVIDIA B200") == "b200 blocks"
    assert gpu_table.lookup(table, "NVIDIA A100-SXM4-80GB") == "h100 blocks"
    # no GPU here (tests run on CPU devices): a plan compiled ahead of time
    assert jax.devices()[0].platform != "gpu"
    assert gpu_table.lookup(table) == table[gpu_table.DEFAULT_GPU]


@pytest.mark.parametrize("module", [cache_attention, stacked_matmul])
def test_every_kernel_table_covers_every_gpu(module):
    assert set(module.GPU_BLOCKS) == set(gpu_table.GPUS)
    assert module.gpu_blocks("NVIDIA H200") is module.GPU_BLOCKS["H200"]


def test_pow2():
    assert [gpu_table.pow2(n) for n in (0, 1, 2, 3, 16, 17, 264)] == [1, 1, 2, 4, 16, 32, 512]
