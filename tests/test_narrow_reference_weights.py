"""On a GPU the float64 reference keeps float32-valued weights as float32 and widens one block at a time
(`Model.stored_weights`): 23 GB less for a 2.8B model. Here the same path runs on the CPU (NARROW_FLOAT64_ON), and
every answer must be bit for bit the one of the plain float64 copy."""
import torch

import mamba_debug.model as model_mod
from mamba_debug.backends import cpu_backend, reference_backend
from mamba_debug.compare import run_compare
from mamba_debug.model import Model
from mamba_debug.settings import RunSettings

from conftest import random_model


def _rounded(model) -> Model:
    params = {k: v.to(torch.float32).to(torch.float64) for k, v in model.params.items()}
    return Model(model.config, params, source="rounded to float32 values")


def _run(model, ids):
    res = run_compare(model, ids, RunSettings(kernels="torch", device="cpu", ubatch=8, n_gen=3, offload=5,
                                              reference="float64"))
    return res


def test_narrow_storage_gives_the_same_bits(monkeypatch):
    base = random_model(3, n_layer=6)
    ids = [(7 * i + 2) % base.config.vocab_size for i in range(21)]
    wide = _run(_rounded(base), ids)
    monkeypatch.setattr(model_mod, "NARROW_FLOAT64_ON", ("cpu",))
    m = _rounded(base)
    narrow = _run(m, ids)
    stored, widen = m.stored_weights(reference_backend("cpu"))
    assert widen and stored is m.stored_weights(cpu_backend("cpu"))[0]      # one float32 copy, shared
    assert all(v.dtype == torch.float32 for v in stored.values())
    for key, e in wide.errors.items():
        for metric, v in e.items():
            assert torch.equal(v.nan_to_num(-1), narrow.errors[key][metric].nan_to_num(-1)), (key, metric)
    assert wide.first_divergence == narrow.first_divergence
    assert torch.equal(wide.tokens, narrow.tokens)


def test_weights_that_are_not_float32_values_stay_float64(monkeypatch):
    """Only those: a transformers checkpoint's A = -exp(A_log), computed in float64, is not a float32 value, and
    it alone kept the whole float64 reference in float64 on the GPU (23 GB more for a 2.8B model)."""
    base = random_model(3, n_layer=6)
    ids = [(5 * i + 1) % base.config.vocab_size for i in range(19)]
    params = {k: v.to(torch.float32).to(torch.float64) for k, v in base.params.items()}
    for k in params:
        if k.endswith(".A"):
            params[k] = -torch.exp(torch.log(-params[k]).to(torch.float32).to(torch.float64))   # from A_log
    params["norm_f"] = params["norm_f"] + 1e-12          # not a float32 value any more
    wide = _run(Model(base.config, params), ids)
    monkeypatch.setattr(model_mod, "NARROW_FLOAT64_ON", ("cpu",))
    m = Model(base.config, params)
    narrow = _run(m, ids)
    stored, widen = m.stored_weights(reference_backend("cpu"))
    f64 = sorted(k for k, v in stored.items() if v.dtype == torch.float64)
    assert widen and f64 == sorted(["norm_f"] + [k for k in params if k.endswith(".A")])
    ref32 = m.stored_weights(cpu_backend("cpu"))[0]
    assert all(stored[k] is ref32[k] for k in stored if k not in f64)          # shared, not copied
    assert all(v.dtype == torch.float32 for v in ref32.values())
    for key, e in wide.errors.items():
        for metric, v in e.items():
            assert torch.equal(v.nan_to_num(-1), narrow.errors[key][metric].nan_to_num(-1)), (key, metric)
    assert wide.first_divergence == narrow.first_divergence and torch.equal(wide.tokens, narrow.tokens)


def test_shipped_checkpoints_keep_only_A_in_float64(monkeypatch):
    from mamba_debug.io.load import load_model
    from mamba_debug.shipped import shipped_dir
    monkeypatch.setattr(model_mod, "NARROW_FLOAT64_ON", ("cpu",))
    m = load_model(shipped_dir("data") / "tiny-mamba")
    stored, widen = m.stored_weights(reference_backend("cpu"))
    assert widen and {k.split(".")[-1] for k, v in stored.items() if v.dtype == torch.float64} == {"A"}


def test_tied_embeddings_stay_one_tensor(monkeypatch):
    """A tied checkpoint's embed and lm_head are one master, one float32 copy and one device clone (a 2.8B model's
    1 GB float64 master and 0.5 GB a float32 copy, not twice); the device's clone is still its own."""
    from mamba_debug.backends import device_backend
    from mamba_debug.io.load import load_model
    from mamba_debug.shipped import shipped_dir
    monkeypatch.setattr(model_mod, "NARROW_FLOAT64_ON", ("cpu",))
    m = load_model(shipped_dir("data") / "tiny-mamba")
    assert m.config.tie_embeddings and m.params["embed"] is m.params["lm_head"]
    for backend in (reference_backend("cpu"), cpu_backend("cpu"), device_backend("torch", "cpu")):
        stored = m.stored_weights(backend)[0]
        assert stored["embed"] is stored["lm_head"], backend.name
    assert m.stored_weights(device_backend("torch", "cpu"))[0]["embed"].data_ptr() != m.stored_weights(
        cpu_backend("cpu"))[0]["embed"].data_ptr()


def test_a_device_side_clones_the_references_float32_copy(monkeypatch):
    """On a GPU whose references hold a float32 copy, a device back-end's weights are that copy cloned on the device
    (no second upload): the same bits as casting the masters, never the same tensors."""
    from mamba_debug.backends import device_backend
    monkeypatch.setattr(model_mod, "NARROW_FLOAT64_ON", ("cpu",))
    m = random_model(5)
    ref32 = m.stored_weights(cpu_backend("cpu"))[0]
    expected = {k: v.to(torch.float32) for k, v in m.params.items()}
    for v in m.params.values():
        v.fill_(float("nan"))                 # read again, the masters would give NaN: they are not read again
    dev, widen = m.stored_weights(device_backend("torch", "cpu"))
    assert not widen and dev.keys() == ref32.keys()
    for k, v in dev.items():
        assert torch.equal(v, expected[k]) and v.data_ptr() != ref32[k].data_ptr(), k
