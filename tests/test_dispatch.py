"""dispatch: the config heuristics and the specs they can ask for."""
import pytest

from flash_reasoning import dispatch


@pytest.mark.parametrize("tokens, expected", [
    (1, (16, 2, 1)), (16, (16, 2, 1)), (17, (32, 2, 2)), (32, (32, 2, 2)),
    (33, (32, 4, 2)), (64, (32, 4, 2)), (65, (64, 4, 2)), (4096, (64, 4, 2)),
    (None, (64, 4, 2))])
def test_decode_config_follows_the_longest_range(tokens, expected):
    assert dispatch.decode_config(128, "sm90", tokens) == expected


def test_split_decode_pipelines_deeper_and_head_dim_256_keeps_its_config():
    assert dispatch.decode_config(128, "sm90", 8, few_programs=True) == (64, 4, 3)
    assert dispatch.decode_config(256, "sm90", 8) == (64, 8, 2)


@pytest.mark.parametrize("arch", ["sm80", "sm89", "sm90"])
def test_every_config_a_call_can_pick_is_required(arch):
    required = set(dispatch.required_specs(arch))
    for dtype in ("float16", "bfloat16"):
        for head_dim in dispatch.HEAD_DIMS:
            for tokens in (None, 1, 16, 17, 32, 33, 64, 65, 5000):
                config = dispatch.decode_config(head_dim, arch, tokens)
                assert dispatch.decode_spec(dtype, head_dim, False, arch, config) in required
                assert dispatch.tree_final_spec(dtype, head_dim, arch, config) in required
                partial = dispatch.tree_partial_config(head_dim, dispatch.BLOCK_M, arch, tokens)
                assert dispatch.tree_partial_spec(dtype, head_dim, dispatch.BLOCK_M, arch,
                                                  partial) in required
            assert dispatch.decode_spec(dtype, head_dim, True, arch) in required
            assert dispatch.tree_partial_spec(dtype, head_dim, 64, arch) in required
