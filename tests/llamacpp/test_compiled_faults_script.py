"""`make compiled-faults` (tests/llamacpp/compiled_faults.py) builds a second llama.cpp, so it is not part of the
suite; this keeps the script from rotting: every edit still finds its one anchor in the source archive CI already
caches (tests/llamacpp/build.sh), and the expected birthplaces follow llama.cpp's split of sequences."""
from __future__ import annotations

import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compiled_faults as cf  # noqa: E402


def test_every_edit_finds_its_one_anchor_in_the_vendored_source():
    if not cf.SDIST.exists():
        pytest.skip(f"{cf.SDIST} is not cached (tests/llamacpp/build.sh downloads it)")
    prefix = f"llama_cpp_python-{cf.VERSION}/vendor/llama.cpp/"
    with tarfile.open(cf.SDIST) as tf:
        texts = {rel: tf.extractfile(prefix + rel).read().decode() for rel in {e[0] for e in cf.EDITS}}
    for rel, anchor, _ in cf.EDITS:
        assert texts[rel].count(anchor) == 1, (rel, anchor[:80])


def test_expected_birthplaces_follow_llama_cpps_split():
    n_prompt = 25
    assert cf.expected("conv_seq1", 8, 1, n_prompt) is None                   # one sequence per ubatch
    assert cf.expected("conv_seq1", 1, 2, n_prompt) == (1, 0, 0, "SSM_CONV")   # -ub 1, 2 sequences: one ubatch
    assert cf.expected("conv_seq1", 1, 3, n_prompt) == (1, 0, 0, "SSM_CONV")   # groups of 2, then 1
    assert cf.expected("scan_B_contig", 1, 1, n_prompt) is None
    assert cf.expected("scan_B_contig", 8, 1, n_prompt) == (0, 1, 0, "y_scan")
    assert cf.expected("scan_state_end", 3, 2, n_prompt) is None               # one token per sequence
    assert cf.expected("scan_state_end", 17, 3, n_prompt) == (0, 4, 0, "ssm_state")
    assert cf.expected("scan_state_end", 512, 2, n_prompt) == (0, 24, 0, "ssm_state")
    assert cf.expected("conv_state_l3", 1, 1, n_prompt) == (0, 0, 3, "conv_state")
    assert set(cf.FAULTS) == {"conv_seq1", "scan_B_contig", "scan_state_end", "conv_state_l3", "rms_skip_last",
                              "mm_late", "emb"}
