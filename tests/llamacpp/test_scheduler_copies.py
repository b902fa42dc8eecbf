"""Op offload (a CUDA build at -ngl 0 or a partial -ngl, 32+ tokens in a ubatch) runs a CPU layer's nodes on CUDA
except the scan, so the scan's y reaches the D-skip ADD as the scheduler's copy ("CUDA0#node_36 (view)#0"). The map
must still name that ADD `y_skip`, and a copy must be resolved among every node of its name: the scan's y and
state are both "node_36 (view)", and B and C both " (view)". (On the H200 a clean run read "DIVERGED at layer 0
y_scan" because a copy of B was read as C.) No library needed: the tensors are ctypes structs."""
import ctypes

from mamba_debug.sides.llamacpp.lib import GgmlTensor
from mamba_debug.sides.llamacpp.nodes import GraphMap, Node

KEEP = []


def tensor(name: str) -> int:
    t = GgmlTensor()
    t.name = name.encode()
    KEEP.append(t)
    return ctypes.addressof(t)


def node(index, name, op, src=(), view_src=0, ne=(512, 40, 1, 1)):
    addr = tensor(name)
    return Node(index, addr, name, op, ne, (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]), 0,
                list(src), view_src, 0, "CUDA0")


def graph(copy_of: str):
    gm = GraphMap({})
    scan = gm.add(node(36, "node_36", "SSM_SCAN", [tensor("cache_s_l0 (view)")], ne=(28672, 1, 1, 1)))
    y = gm.add(node(37, "node_36 (view)", "VIEW", [scan.addr], scan.addr))
    gm.add(node(38, "node_36 (view)", "VIEW", [scan.addr], scan.addr, ne=(8192, 1, 1, 1)))
    other = gm.add(node(39, "node_27", "SILU", [tensor("blk.0.ssm_conv1d.bias")]))
    dx = gm.add(node(54, "node_54", "MUL", [tensor("blk.0.ssm_d"), other.addr]))
    add = gm.add(node(55, "node_55", "ADD", [tensor(f"CUDA0#{copy_of}#0"), dx.addr]))
    return gm, scan, y, add


def test_the_skip_add_reading_a_copy_of_y_is_y_skip():
    gm, scan, y, add = graph("node_36 (view)")
    assert scan.site == "y_scan" and add.layer == 0
    assert add.site == "y_skip"
    assert y in gm.sources(add.src[0]) and len(gm.sources(add.src[0])) == 2      # y and the state: both views


def test_an_add_reading_a_copy_of_something_else_is_not_y_skip():
    gm, _, _, add = graph("node_27")
    assert add.site != "y_skip" and add.site.startswith("ADD")
    assert [n.name for n in gm.sources(add.src[0])] == ["node_27"]
