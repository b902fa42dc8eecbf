"""The eval callback's C fast path (fastpath.c / fastpath.py) and the context kept between runs (contexts.py) change no
answer: a run through them gives the JSON of a run with the Python callback alone in a new context; the JSON says
which ran; a kept context is used by the next run of the same settings only; where the C file cannot be compiled
the Python callback runs and the JSON says why.
"""
from __future__ import annotations

import pytest
from conftest import llama_answers

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")

from mamba_debug.compare import run_compare  # noqa: E402
from mamba_debug.io import export_gguf, load_model  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.sides.llamacpp import contexts, fastpath  # noqa: E402
from mamba_debug.views.summary import to_json  # noqa: E402

PROMPT = "It was a fine morning in the country, and Mr. Darcy"


@pytest.fixture(scope="module")
def subject(tmp_path_factory):
    path = export_gguf(load_model(None), tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", dtype="f32")
    model = load_model(path)
    return model, model.encode(PROMPT)


@pytest.fixture(autouse=True)
def nothing_kept():
    contexts.release()
    yield
    contexts.release()


def run(subject, ubatch: int, n_seqs: int) -> dict:
    model, ids = subject
    return to_json(run_compare(model, ids, RunSettings(engine="llama.cpp", device="cpu", ubatch=ubatch,
                                                       n_seqs=n_seqs, n_gen=3)))


def same(a: dict, b: dict) -> bool:
    """The same answer: all but the timings and the words on how it was reached."""
    return llama_answers(a) == llama_answers(b)


def test_the_fast_path_and_a_kept_context_change_no_answer(subject, monkeypatch):
    made, init = [], fastpath.FastPath.__init__
    monkeypatch.setattr(fastpath.FastPath, "__init__", lambda self, *a: made.append(self) or init(self, *a))
    monkeypatch.setenv("MAMBA_DEBUG_NO_FASTPATH", "1")
    monkeypatch.setenv("MAMBA_DEBUG_LLAMA_KEEP", "0")
    plain = run(subject, 3, 2)
    assert plain["config"]["llama_cpp"]["callback"] == "Python (off by request)" and not made
    monkeypatch.delenv("MAMBA_DEBUG_NO_FASTPATH")
    monkeypatch.setenv("MAMBA_DEBUG_LLAMA_KEEP", "1")
    first = run(subject, 3, 2)
    assert first["config"]["llama_cpp"]["callback"].startswith("C fast path") and len(made) == 1
    assert first["config"]["llama_cpp"]["context"] == "new" and same(first, plain)
    before = made[0].counts()
    again = run(subject, 3, 2)
    assert again["config"]["llama_cpp"]["context"] == "kept from the previous run" and len(made) == 1
    assert same(again, plain)
    c = {k: v - before[k] for k, v in made[0].counts().items()}
    # the second run's graphs are all known: C answers every ask and observe but the first node's of each decode
    # (there the Python callback starts the graph: the tokens it embeds) and copies every value a site needs
    n_decodes = len(subject[1]) + 3             # -ub 3 over 2 sequences: one token a sequence per ubatch
    assert c["c_asks"] > 20 * c["python_calls"] and c["c_observes"] > 0 and c["python_calls"] <= 2 * n_decodes, c


def test_a_kept_context_serves_its_own_settings_only(subject):
    import mamba_debug as md
    run(subject, 3, 2)
    assert contexts._KEPT["context"][0][1:3] == (3, 2)
    other = run(subject, 4, 1)
    assert other["config"]["llama_cpp"]["context"] == "new"
    assert contexts._KEPT["context"][0][1:3] == (4, 1)
    md.release_llama_cpp()                      # what a notebook calls to give the memory back
    assert not contexts._KEPT


def test_without_a_compiler_the_python_callback_runs_and_says_why(subject, monkeypatch, tmp_path):
    monkeypatch.setattr(fastpath, "_LOADED", {})
    monkeypatch.setenv("MAMBA_DEBUG_CACHE", str(tmp_path))        # no library compiled before
    monkeypatch.setenv("CC", "false")
    got = run(subject, 2, 1)
    why = got["config"]["llama_cpp"]["callback"]
    assert why.startswith("Python (the C fast path is not available (false failed on ") and "fastpath.c" in why
    monkeypatch.setattr(fastpath, "_LOADED", {})
    monkeypatch.delenv("CC")
    contexts.release()
    assert same(run(subject, 2, 1), got)


def test_what_is_remembered_on_disk_gives_the_same_answers(subject, monkeypatch, tmp_path, read_node_calls):
    """recall_disk.py: a new process (here: recall.py's memory emptied, no context kept) recalls its first graphs
    from the trie an earlier run wrote, with the answers of a run that mapped every graph node by node; a file that
    does not read, or that names any class, is a cache miss (removed, mapped node by node again)."""
    import pickle
    from collections import OrderedDict

    import numpy as np

    import os

    from mamba_debug.sides.llamacpp import recall, recall_disk
    calls = read_node_calls
    monkeypatch.setenv("MAMBA_DEBUG_CACHE", str(tmp_path))

    def new_process(keep: str = "1") -> dict:
        contexts.release()
        monkeypatch.setattr(recall, "_MEMORY", OrderedDict())
        monkeypatch.setenv("MAMBA_DEBUG_LLAMA_KEEP", keep)
        calls["read_node"] = 0
        return run(subject, 8, 1)
    plain = new_process("0")                # nothing kept, nothing on disk: every first graph node by node
    mapped = calls["read_node"]
    assert mapped > 1000 and not (tmp_path / "recall").exists()
    assert same(new_process(), plain)       # node by node again; the trie written
    files = list((tmp_path / "recall").glob("*.pkl"))
    assert len(files) == 1 and calls["read_node"] == mapped
    assert same(new_process(), plain) and calls["read_node"] < mapped / 20, calls     # recalled from disk
    for i in range(recall_disk.MAX_FILES + 4):       # the folder is bounded: the oldest files go
        old = tmp_path / "recall" / f"old{i}.pkl"
        old.write_bytes(b"")
        os.utime(old, ns=(i, i))
    contexts.release()
    monkeypatch.setattr(recall, "_MEMORY", OrderedDict())
    calls["read_node"] = 0
    run_one = run(subject, 2, 1)                    # another graph kind: its trie grows, is written, the folder pruned
    left = list((tmp_path / "recall").glob("*.pkl"))
    assert len(left) == recall_disk.MAX_FILES and files[0] in left and run_one["first_divergence"] is None
    for junk in (b"not a pickle", pickle.dumps((1, 5, [(-1, None, None)], np.float32))):
        files[0].write_bytes(junk)
        assert same(new_process(), plain) and calls["read_node"] == mapped          # refused: node by node
        assert files[0].read_bytes() != junk                                        # and written anew


def test_a_failed_run_keeps_its_model_but_not_its_context(subject, monkeypatch):
    from mamba_debug.sides.llamacpp import side as lside

    def broken(node, array, u, first_seq):
        raise RuntimeError("the fault hook failed")
    monkeypatch.setattr(lside, "FAULT", broken)
    with pytest.raises(RuntimeError, match="the fault hook failed"):
        run(subject, 2, 1)
    assert "context" not in contexts._KEPT and "model" in contexts._KEPT
    monkeypatch.setattr(lside, "FAULT", None)
    assert run(subject, 2, 1)["config"]["llama_cpp"]["context"] == "new"
