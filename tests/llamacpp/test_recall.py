"""recall.py: what the eval callback remembers across contexts gives, in a new context, the map and the values that
mapping every node node by node gives; it is used (a new context's graphs are not mapped node by node again), it is
never another model's, a graph that differs from the remembered one is mapped node by node from where it differs,
and what is remembered is bounded and holds no address, buffer or value.
"""
from __future__ import annotations

import shutil
from collections import OrderedDict

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")

from mamba_debug.compare import sequence_prompts  # noqa: E402
from mamba_debug.io import export_gguf, load_model  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.sides.llamacpp import observe, recall  # noqa: E402
from mamba_debug.sides.llamacpp import side as lside  # noqa: E402

PROMPT = "It was a fine morning in the country, and Mr. Darcy"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return export_gguf(load_model(None), tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", dtype="f32")


@pytest.fixture
def fresh(monkeypatch, read_node_calls):
    """Nothing remembered from other tests; read_node calls counted (the node-by-node path's cost); every side in
    a new context (none kept between runs: contexts.py), as recall.py is about new contexts."""
    from mamba_debug.sides.llamacpp import contexts  # noqa: PLC0415
    contexts.release()
    monkeypatch.setenv("MAMBA_DEBUG_LLAMA_KEEP", "0")
    monkeypatch.setattr(recall, "_MEMORY", OrderedDict())
    return read_node_calls


def describe(nodes: list) -> list:
    """A graph's Nodes without their addresses: sources as graph indices or names."""
    at = {n.addr: n.index for n in nodes}
    return [(n.index, n.name, n.op, n.ne, n.nb, n.type, n.view_offs, n.backend, n.layer, n.site,
             tuple(at.get(s, "leaf") for s in n.src), at.get(n.view_src, n.view_src and "leaf"),
             {k: v for k, v in n.extra.items() if k != "views"}) for n in nodes]


def trace(path, ubatch: int, n_seqs: int, monkeypatch, node_by_node: bool = False) -> list:
    """One schedule (the prompt, then 3 generated tokens) through a new side: per ubatch, its graph described and
    the site values handed to compare. node_by_node: every node mapped and read one by one (--local's path)."""
    model = load_model(path)
    ids = model.encode(PROMPT)
    s = RunSettings(engine="llama.cpp", device="cpu", ubatch=ubatch, n_seqs=n_seqs, n_gen=3).validated(model.config)
    begin, end, out = observe.Tracer.begin, observe.Tracer.end, []

    def legacy_begin(self, *a, **kw):
        begin(self, *a, **kw)
        self.legacy = node_by_node

    def described_end(self):
        graphs = end(self)
        out.append([describe(observe.graph_nodes(g)) for g in graphs])
        return graphs
    monkeypatch.setattr(observe.Tracer, "begin", legacy_begin)
    monkeypatch.setattr(observe.Tracer, "end", described_end)
    side = lside.LlamaCppSide(model, s)
    try:
        tokens = sequence_prompts(ids, n_seqs, model.config.vocab_size)
        B = s.ubatch_per_seq(n_seqs)
        side.reset(s, n_seqs)
        steps, nxt = [], None
        n_prompt = len(range(0, tokens.shape[1], B))
        for u in range(n_prompt + s.n_gen):
            step = side.step(tokens[:, u * B:(u + 1) * B] if u < n_prompt else nxt[:, None])
            nxt = step.logits[:, -1].argmax(-1)
            steps.append((out[-1], step.sites))
        return steps
    finally:
        side.close()
        monkeypatch.setattr(observe.Tracer, "begin", begin)
        monkeypatch.setattr(observe.Tracer, "end", end)


def same(a: list, b: list):
    assert len(a) == len(b)
    for u, ((ga, sa), (gb, sb)) in enumerate(zip(a, b)):
        assert ga == gb, f"ubatch {u}: the graph maps differ"
        assert sa.keys() == sb.keys(), u
        for k in sa:
            assert torch.equal(sa[k][0], sb[k][0]) and sa[k][1] == sb[k][1], (u, k)


def test_new_contexts_recall_the_map_with_the_same_answers(gguf, fresh, monkeypatch):
    """Contexts of other -ub and sequence counts in one process, one after the other and back: every graph's map
    and every site value as mapped node by node; the second context of a setting maps no node node by node."""
    settings = [(3, 2), (8, 1), (3, 2), (8, 1), (2, 3)]
    truth = {st: trace(gguf, *st, monkeypatch, node_by_node=True) for st in set(settings)}
    fresh["read_node"] = 0
    seen = set()
    for st in settings:
        before = fresh["read_node"]
        same(trace(gguf, *st, monkeypatch), truth[st])
        if st in seen:          # only the tokens' input of each graph start is read (observe._start)
            assert fresh["read_node"] - before <= len(truth[st]), (st, fresh["read_node"] - before)
        seen.add(st)


def test_a_graph_that_differs_from_the_remembered_one(gguf, fresh, monkeypatch):
    """The remembered graph made to differ at one node (its key there changed, as if that node had another name):
    the new context's graph follows what is remembered up to that node, maps the rest node by node (the nodes
    before it mapped again from their live structs), and answers as node by node."""
    truth = trace(gguf, 8, 1, monkeypatch, node_by_node=True)
    trace(gguf, 8, 1, monkeypatch)
    (memory,) = recall._MEMORY.values()
    step, k = memory.root, 300
    for _ in range(k):          # the first graph's path (a fresh ubatch of 8 tokens) to its node k
        step = next(iter(step.kids.values()))
    key, kid = next(iter(step.kids.items()))
    del step.kids[key]
    step.kids[(key[0] + b"x",) + key[1:]] = kid
    fresh["read_node"] = 0
    same(trace(gguf, 8, 1, monkeypatch), truth)
    n_nodes = len(truth[0][0][0])
    assert fresh["read_node"] >= n_nodes, fresh     # node k on, and the k before it again: node by node
    assert fresh["read_node"] < 2 * n_nodes, fresh  # the other graphs recalled


def test_another_model_never_takes_this_ones_map(gguf, fresh, monkeypatch, tmp_path):
    """What is remembered is keyed by the GGUF file (path, size, mtime) and the library: the same model under
    another path starts from nothing (its graphs mapped node by node), and each file keeps its own trie."""
    other = tmp_path / "copy-f32.gguf"
    shutil.copyfile(gguf, other)
    trace(gguf, 8, 1, monkeypatch)
    cold = fresh["read_node"]
    fresh["read_node"] = 0
    same(trace(other, 8, 1, monkeypatch), trace(gguf, 8, 1, monkeypatch, node_by_node=True))
    assert fresh["read_node"] >= cold > 1000, (cold, fresh)
    keys = list(recall._MEMORY)
    assert len(keys) == 2 and {k[3][0] for k in keys} == {str(gguf.resolve()), str(other.resolve())}
    assert lside.model_key(gguf)[0] == str(gguf.resolve())


def test_what_is_remembered_is_small_and_bounded(gguf, fresh, monkeypatch):
    """No address, buffer or value: a remembered step holds names, ops, layers, sites, flags and shapes; the same
    graphs again add nothing; past MAX_KEPT steps a model's trie starts over, past MAX_MODELS models the oldest
    goes."""
    trace(gguf, 3, 2, monkeypatch)
    (memory,) = recall._MEMORY.values()
    steps = memory.steps
    trace(gguf, 3, 2, monkeypatch)
    assert memory.steps == steps and 0 < steps < 3000
    todo = [memory.root]
    while todo:
        k = todo.pop()
        todo.extend(k.kids.values())
        for key in k.kids:
            assert all(not isinstance(i, int) or -1 <= i < 2000 for i in key[2]), key    # indices, not addresses
        if k is not memory.root:
            for v in (k.name, k.op, k.layer, k.site, k.backend, k.size, k.emb, k.conv, k.view, *k.extra.values()):
                assert not isinstance(v, (np.ndarray, torch.Tensor, bytearray, memoryview))
    monkeypatch.setattr(recall, "MAX_KEPT", steps - 1)
    assert recall.memory(next(iter(recall._MEMORY))) is not memory          # full: started over
    for i in range(recall.MAX_MODELS + 2):
        recall.memory(("model", i))
    assert len(recall._MEMORY) == recall.MAX_MODELS


def test_a_tracer_without_a_model_key_remembers_nothing(gguf, fresh, monkeypatch):
    """Tracer(..., model=None): every context maps node by node, with the same answers, and nothing is kept."""
    truth = trace(gguf, 8, 1, monkeypatch, node_by_node=True)
    monkeypatch.setattr(lside, "model_key", lambda path: None)
    monkeypatch.setattr(recall, "_MEMORY", OrderedDict())
    for _ in range(2):
        before = fresh["read_node"]
        same(trace(gguf, 8, 1, monkeypatch), truth)
        assert fresh["read_node"] - before > 100          # mapped node by node again
    assert not recall._MEMORY
