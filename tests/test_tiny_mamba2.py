"""The shipped tiny Mamba-2 and Granite-style hybrid (data/tiny-mamba2, data/tiny-granite-hybrid): they load by name
from any working folder, match transformers' forward, write English-like text, and keep data/ within its budget."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mamba_debug as md

DATA = Path(__file__).resolve().parent.parent / "data"
NAMES = ["tiny-mamba2", "tiny-granite-hybrid"]


@pytest.mark.parametrize("name", NAMES)
def test_loads_by_name_and_matches_transformers(name, monkeypatch, tmp_path):
    if not (DATA / name / "config.json").is_file():
        pytest.skip(f"data/{name} is not there")
    monkeypatch.chdir(tmp_path)                                   # by name, from any folder
    model = md.load_model(name)
    assert model.tokenizer is not None and (DATA / name / "model.safetensors").stat().st_size <= 12 * 2 ** 20
    kinds = set(model.config.layer_types)
    assert kinds == ({"mamba2"} if name == "tiny-mamba2" else {"mamba2", "attention"})
    assert model.config.n_groups > 1
    ids = model.encode("It was a fine morning, and she")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(DATA / name).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), use_cache=False).logits.double()
    ours = model.logits(torch.tensor([ids]))
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4
    text = model.decode(model.generate(torch.tensor([ids]), 8)[0])
    assert sum(c.isalpha() for c in text) > len(text) // 2


def test_data_stays_within_budget():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total <= 40 * 2 ** 20, f"data/ holds {total / 2 ** 20:.1f} MiB"
