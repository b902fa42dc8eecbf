import pytest

from mamba_debug.errors import MambaDebugError
from mamba_debug.placement import Placement


@pytest.mark.parametrize("offload,first,head", [(0, 12, False), (1, 11, False), (5, 7, False), (12, 0, False),
                                                (13, 0, True), (99, 0, True)])
def test_llama2024_rule_offloads_the_last_blocks_then_the_head(offload, first, head):
    p = Placement(12, offload)
    assert (p.first_device_layer, p.head_on_device) == (first, head)


@pytest.mark.parametrize("offload,first,head", [(0, 12, False), (1, 12, True), (2, 11, True), (13, 0, True),
                                                (14, 0, True)])
def test_llama2025_rule_offloads_the_head_first(offload, first, head):
    p = Placement(12, offload, "llama2025")
    assert (p.first_device_layer, p.head_on_device) == (first, head)


def test_bad_placement_is_a_clear_error():
    with pytest.raises(MambaDebugError, match="offload must be"):
        Placement(12, -1)
    with pytest.raises(MambaDebugError, match="unknown placement rule"):
        Placement(12, 1, "vllm")
