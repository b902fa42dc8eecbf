"""`LlamaCppSide`: a llama.cpp build as the device side, traced through its eval callback (see nodes.py, lib.py).

One context with n_seq_max = S state slots; each step is one `llama_batch` of S x T tokens, sequence-major, with
n_ubatch = RunSettings.ubatch (llama.cpp's -ub), so llama.cpp's equal split makes exactly the ubatch compare asked
for; the side checks that (one graph, its `inp_tokens` and its SSM_CONV's [T, S]) and refuses otherwise.
Graphs of llama.cpp's `mamba`, `mamba2` and `granitehybrid` architectures (nodes.py, maps.py).
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Optional

import numpy as np
import torch

from ...errors import MambaDebugError
from ...settings import RunSettings
from ...trace import SideInfo
from ..base import StepOutput
from .gguf_file import gguf_for, matmul_weights_narrower, model_key
from .lib import LogCallback, load_library
from . import contexts
from .observe import Tracer, graph_nodes
from .reference import derived_sites
from .local import CUBLAS_FP32, LocalErrors, path_of
from .precision import judge, refine, rounding_at_its_token, settle
from .maps import LAYER_SITES as OTHER_SITES
from .maps import NOT_OBSERVED, layer_kinds
from .nodes import HEAD_SITES, LAYER_SITES, weight_type

# Tests inject faults here: fn(node, array, ubatch_index, first_seq) is called in the observe call of every node that
# is not empty, before it is read; `array` is a writable view of the node's own memory (CPU build), so later nodes
# consume it. Read at the start of each decode.
FAULT: Optional[Callable] = None


class LlamaCppSide:
    def __init__(self, model, s: RunSettings):
        self.model, self.cfg, self.s = model, model.config, s
        self.fp32 = _fp32_everywhere(s)
        self.lib = load_library(s.llama_lib, s.device)
        self.gguf = gguf_for(model)
        self.u = -1
        self.n_seqs, self.n_slots, self.first_seq = None, None, 0
        # --local: measured during the run. Otherwise only when the verdict needs them (judge): reading every node
        # and recomputing it in float64 made a clean CUDA run 400x its untraced time (issue #18, goal 5)
        self.local = LocalErrors(s.k_floor, device=_local_device(s), emulate=self.lib.rounding) if s.local else None
        self.kinds = layer_kinds(self.cfg)
        self.tracer = None
        self._load()

    # -- setup ------------------------------------------------------------------------------------
    def _load(self):
        lib = self.lib
        if self.s.device == "cuda" and CUBLAS_FP32["at_init"] is None:     # the first CUDA run in this process:
            CUBLAS_FP32["at_init"] = os.environ.get("NVIDIA_TF32_OVERRIDE") == "0"   # what its cuBLAS reads
        lib.llama_backend_init()
        if not os.environ.get("MAMBA_DEBUG_LLAMA_LOG"):
            quiet = LogCallback(lambda level, text, ud: None)
            contexts.KEEP_ALIVE.append(quiet)
            lib.llama_log_set(ctypes.cast(quiet, ctypes.c_void_p), None)
        mp = lib.llama_model_default_params().params
        mp.n_gpu_layers = 0 if self.s.device == "cpu" else self.s.offload
        split = self._split(mp)
        self.model_key = (str(lib.path), model_key(self.gguf), self.s.device, mp.n_gpu_layers, repr(split))
        self.lmodel = contexts.take_model(self.model_key, lib) or \
            lib.llama_model_load_from_file(str(self.gguf).encode(), mp)
        if not self.lmodel:
            raise MambaDebugError(f"{self.gguf}: {lib.path} could not load this GGUF (run with "
                                  f"MAMBA_DEBUG_LLAMA_LOG=1 to see llama.cpp's log)")
        n_layer = lib.llama_model_n_layer(self.lmodel)
        if n_layer != self.cfg.n_layer:
            raise MambaDebugError(f"{self.gguf}: llama.cpp reads {n_layer} layers, the reference {self.cfg.n_layer}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.lmodel))
        self.reduced_weights = matmul_weights_narrower(self.gguf)
        self.ctx = self.mem = None
        self.n_tokens = 0
        self.info = SideInfo("device", self._label(), None, self.s.device, "llama.cpp",
                             extra={"library": str(self.lib.path), "version": self.lib.version,
                                    "commit": self.lib.commit, "devices": [list(d) for d in self.lib.devices],
                                    "gguf": str(self.gguf),
                                    "op_offload": self._op_offload(),
                                    "n_gpu_layers": mp.n_gpu_layers, "n_threads": self._threads(),
                                    "fp32_everywhere": self.fp32, "layer_kinds": list(self.kinds), **split,
                                    **({"kv_cache": "f32", "flash_attn": False} if "attention" in self.kinds
                                       else {}), "nodes": []})

    def _split(self, mp) -> dict:
        """--devices: llama.cpp's split_mode layer with a tensor_split array over the build's GPUs (what it records
        in the JSON); nothing set without --devices."""
        if not self.s.devices:
            return {}
        shares = split_array(self.s.devices, self.s.tensor_split, self.lib.devices)
        self._tensor_split = (ctypes.c_float * len(shares))(*shares)
        contexts.KEEP_ALIVE.append(self._tensor_split)          # alive as long as the model (kept: longer)
        mp.split_mode = SPLIT_MODE_LAYER
        mp.tensor_split = ctypes.cast(self._tensor_split, ctypes.c_void_p)
        return {"split_mode": "layer", "tensor_split": list(shares), "split_devices": list(self.s.devices)}

    def _label(self) -> str:
        return (f"llama.cpp {self.s.device.upper()} build {self.lib.path} ({self.lib.version}), "
                f"-ngl {0 if self.s.device == 'cpu' else self.s.offload}, -ub {self.s.ubatch}")

    def _op_offload(self) -> bool:
        """--device cpu means CPU: on a CUDA build, op offload would send big-batch ops to the GPU even at -ngl 0."""
        return self.s.op_offload and not self.s.fp32_everywhere and self.s.device != "cpu"

    def _threads(self) -> int:
        return int(os.environ.get("MAMBA_DEBUG_LLAMA_THREADS") or max(1, min(8, (os.cpu_count() or 2) // 2)))

    def _context(self, n_seqs: int, n_tokens: int):
        """A context for n_seqs sequences of up to n_tokens each (or the previous run's, kept with that key)."""
        lib, first = self.lib, not self.ctx
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = self.mem = None      # a failed init below must not leave a freed context to free again
        self.context_key = (n_tokens, self.s.ubatch, n_seqs, self._threads(), self._op_offload())
        kept = contexts.take_context(self.context_key) if first else None
        if kept is not None:        # the previous run's context (contexts.py): its graphs are known
            self.ctx, self.mem, self.tracer = kept.ctx, kept.mem, kept.tracer
            self.info.extra.update(callback=kept.callback_text, context="kept from the previous run")
            return
        cp = lib.llama_context_default_params().params
        cp.n_ctx = n_seqs * (n_tokens + 8)  # split between the sequences (a KV cache per sequence, not unified)
        cp.n_batch = cp.n_ctx
        cp.n_ubatch = self.s.ubatch
        cp.n_seq_max = n_seqs
        cp.n_threads = cp.n_threads_batch = self._threads()
        cp.op_offload = self._op_offload()
        cp.no_perf = True
        if "attention" in self.kinds:       # an f32 KV cache (llama.cpp's default f16 one alone costs ~3e-4), read
            cp.type_k = cp.type_v = 0       # as f32: flash attention would cast K and V to f16 (llama-graph.cpp)
            cp.flash_attn_type = 0          # LLAMA_FLASH_ATTN_TYPE_DISABLED
        if self.tracer is not None:         # its callback stays alive (KEEP_ALIVE): free what it holds
            self.tracer.release()
        self.tracer = Tracer(self.lib, self.kinds, self.observed_sites(), model_key(self.gguf),  # this context's
                             gguf_path=self.gguf)
        self.info.extra.update(callback=contexts.callback(lib, self.tracer, cp), context="new")
        self.ctx = lib.llama_init_from_model(self.lmodel, cp)
        if not self.ctx:
            raise MambaDebugError(f"{lib.path}: llama_init_from_model failed for n_seq_max {n_seqs}, -ub "
                                  f"{self.s.ubatch} (MAMBA_DEBUG_LLAMA_LOG=1 shows llama.cpp's log)")
        self.mem = lib.llama_get_memory(self.ctx)

    # -- the Side seam ----------------------------------------------------------------------------
    def reset(self, settings: RunSettings, n_seqs: int, first_seq: int = 0, n_tokens: int = 0):
        """Fresh states for sequences first_seq .. first_seq + n_seqs - 1, in a context with a slot for each of the
        run's sequences (a group of them when -ub + 1 < n_seqs: llama.cpp's own seq ids, never renumbered) and
        room for n_tokens each (in steps of 4096: runs of other prompts keep one context)."""
        room = 4096 * -(-max(n_tokens, 1) // 4096)
        if self.ctx is None or settings.n_seqs != self.n_slots or room > self.n_tokens:
            self._context(settings.n_seqs, room)
            self.n_slots, self.n_tokens = settings.n_seqs, room
        self.lib.llama_memory_clear(self.mem, True)
        self.n_seqs, self.first_seq, self.u, self.pos = n_seqs, first_seq, -1, [0] * n_seqs
        self._prev_conv = {}
        if first_seq == 0:
            self._history = []

    def _mapped(self, i: int) -> tuple:
        """Layer i's sites that llama.cpp has a node for, in its graph order."""
        kind = self.kinds[i]
        return LAYER_SITES if kind == "mamba1" else tuple(s for s in OTHER_SITES[kind] if s not in NOT_OBSERVED)

    def observed_sites(self) -> frozenset:
        return frozenset([(i, s) for i in range(self.cfg.n_layer) for s in self._mapped(i)] +
                         [(None, s) for s in HEAD_SITES])

    def layer_sites(self) -> list:
        """Each layer's own sites in llama.cpp's graph order, with the reference's sites llama.cpp lacks in place."""
        out = []
        for kind in self.kinds:
            if kind == "mamba1":
                order = list(LAYER_SITES)
                order.insert(order.index("y_gated"), "gate")
                out.append(tuple(order))
            else:
                out.append(OTHER_SITES[kind])
        return out

    def step(self, tokens: torch.Tensor) -> StepOutput:
        self.u += 1
        t0 = time.perf_counter()
        logits, graphs = self._decode(tokens, trace=True)
        if len(graphs) != 1:
            raise MambaDebugError(f"llama.cpp split the ubatch of {tokens.shape[0]} x {tokens.shape[1]} tokens into "
                                  f"{len(graphs)} graphs; compare asked for one (-ub {self.s.ubatch}): refusing "
                                  f"to compare another schedule than the one the reference ran")
        g = graphs[0]
        self._check_schedule(g, tokens)
        if self.u == 0 and self.first_seq == 0:
            self.info.extra["nodes"] = [{"index": n.index, "layer": n.layer, "site": n.site, "op": n.op,
                                         "name": n.name, "backend": n.backend, "path": path_of(n, self._weights(n)),
                                         "ne": list(n.ne)} for n in graph_nodes(g, sited=True)]
            if self.s.devices:      # which backend buffer each block's (and the head's) nodes were read from
                self.info.extra["layer_backends"] = layer_backends(self.info.extra["nodes"])
        self._history.append((self.first_seq, tokens, logits, time.perf_counter() - t0))
        try:
            sites = self._sites(g, tokens.shape[0], tokens.shape[1], logits)
        except ValueError as exc:       # a node of another shape than the graph this map reads
            raise MambaDebugError(f"{self.lib.path}: a node of ubatch {self.u} does not have the shape the node map "
                                  f"expects for [T, S] = [{tokens.shape[1]}, {tokens.shape[0]}] ({exc}); is this "
                                  f"a {'/'.join(sorted(set(self.kinds)))} graph of llama.cpp 0c1e570?") from exc
        return StepOutput(logits, sites)

    def _weights(self, node) -> int:
        """A MUL_MAT's weights' ggml type (its arithmetic path, local.path_of); 0 for any other node."""
        return weight_type(self.lib, node.src[0]) if node.op == "MUL_MAT" and node.src else 0

    def reference_sites(self, sites: dict, tokens: torch.Tensor) -> dict:
        """What this side's op-named nodes should hold, from a reference side's sites of the same ubatch."""
        prev = self._prev_conv.setdefault(sites[(None, "logits")][0].dtype, {})   # one per reference side
        return derived_sites(sites, tokens, self.model.params, self.cfg, prev, self.kinds)

    def observer_effect(self) -> dict:
        """The whole schedule again from empty states with nothing observed (the callback answers no to every ask):
        its logits against the traced run's, bitwise, and the time of both. Leaves the states at the schedule's end."""
        first, worst, untraced = None, 0.0, 0.0
        for u, (first_seq, tokens, logits, _) in enumerate(self._history):
            if u == 0 or first_seq != self.first_seq:       # a new group of sequences starts from empty states
                self.lib.llama_memory_clear(self.mem, True)
                self.first_seq, self.n_seqs, self.pos = first_seq, tokens.shape[0], [0] * tokens.shape[0]
            t0 = time.perf_counter()
            plain = self._decode(tokens, trace=False)[0]
            untraced += time.perf_counter() - t0
            if not torch.equal(plain, logits):
                first = u if first is None else first
                worst = max(worst, float((plain - logits).abs().max()))
        out = {"logits_bitwise_identical": first is None, "first_different_ubatch": first, "max_abs_diff": worst,
               "traced_s": round(sum(h[-1] for h in self._history), 4), "untraced_s": round(untraced, 4),
               "untraced_means": "the eval callback answers no to every ask (in C, where the fast path runs)"}
        self.info.extra.update(observer_effect=out, copies=self.tracer.copies())
        if self.local is not None:
            self.info.extra["local"] = self.local.to_dict()
        return out

    def judge(self, res):
        """(first_divergence, precision): the precision-aware verdict (precision.py). A run without local errors
        (no --local) that diverged is replayed with them (the backend is deterministic for one schedule: the replay's
        logits are checked bit for bit against the traced run's):
        - on the CPU up to the divergence's ubatch, to find a fault born in a node that has no reference value, and
          over the whole schedule when nothing at the divergence's token points at a node (whether it is rounding,
          `precision.settle`, needs every ubatch: a later fault must not hide behind it);
        - on CUDA the whole schedule: TF32 matmuls drift past the float32 threshold on a clean run, and only every
          node's local error tells that from a fault, in any ubatch (a later fault must not hide behind an excused
          drift).
        A run that passed no threshold is clean without them, on CUDA as on the CPU: a node past its own limit whose
        error never reaches a compared site past its threshold (a state copy in the last ubatch) is reported only
        with --local, which always-on local errors on CUDA used to report at 130-400x the untraced time."""
        if self.local is not None:
            return self._verdict(res)
        fd = res.first_divergence
        if fd is None:
            return fd, None
        partial = None
        try:
            if not _replay_whole(self.s, self.reduced_weights):
                if not self._replay_local(fd):      # another run's local errors would not explain this one
                    return fd, None
                out = refine(res, fd, self.local)
                if not rounding_at_its_token(out):
                    return out, None            # named, or not rounding whatever the other ubatches hold
                partial = self.info.extra["local_replay"]
            if not self._replay_local(None, earlier=partial):
                return fd, None
            self.info.extra["local"] = self.local.to_dict()
            return self._verdict(res)
        finally:
            self.local = None

    def _replay_local(self, fd: Optional[dict], earlier: Optional[dict] = None) -> bool:
        """Replay with fresh local errors up to fd's ubatch (None: every ubatch of every group), recorded as
        `local_replay` (its seconds include an `earlier` partial replay's); whether the replay gave the traced
        run's logits bit for bit."""
        self.local = LocalErrors(self.s.k_floor, device=_local_device(self.s), emulate=self.lib.rounding)
        t0 = time.perf_counter()
        same = self._replay(fd)
        self.info.extra["local_replay"] = {
            "until_ubatch": None if fd is None else fd["ubatch"], "same_bits": same,
            "ubatches": len({key[:2] for key in self.local.index_of}),     # (ubatch, group) pairs replayed
            "seconds": round(time.perf_counter() - t0 + (earlier or {}).get("seconds", 0.0), 3),
            **self.local.to_dict()}
        return same

    def _verdict(self, res):
        """The verdict from every ubatch's local errors: precision.judge, then (no reduced-precision node) settle."""
        fd, prec = judge(res, self.local)
        return settle(res, fd, self.local) if prec is None and not self.local.reduced else (fd, prec)

    def _replay(self, fd: Optional[dict]):
        """The schedule again, traced: from the start of fd's group of sequences up to fd's ubatch, or every group
        to the end (fd None); whether every replayed ubatch gave the traced run's logits bit for bit."""
        u, same, group = -1, True, None
        for first_seq, tokens, logits, _ in self._history:
            if fd is not None and not first_seq <= fd["seq"] < first_seq + tokens.shape[0]:
                continue
            u = 0 if first_seq != group else u + 1
            if u == 0:
                group = first_seq
                self.lib.llama_memory_clear(self.mem, True)
                self.first_seq, self.n_seqs, self.pos = first_seq, tokens.shape[0], [0] * tokens.shape[0]
            self.u = u
            same &= torch.equal(self._decode(tokens, trace=True)[0], logits)   # the replay must be the same run
            if fd is not None and u == fd["ubatch"]:
                break
        return same

    def close(self):
        """Free the context and the model, or keep them for the next run with the same settings (contexts.py; a
        sweep builds one side per cell)."""
        bundle = contexts.Bundle(self.ctx, self.mem, self.tracer, self.info.extra.get("callback"))
        if contexts.keep(self.lib, self.model_key, self.lmodel, getattr(self, "context_key", None), bundle):
            self.ctx = self.lmodel = self.tracer = None
            return
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if self.lmodel:
            self.lib.llama_model_free(self.lmodel)
            self.lmodel = None
        if self.tracer is not None:
            self.tracer.release()

    def save_state(self) -> object:
        out = []
        for s in range(self.n_seqs):
            n = self.lib.llama_state_seq_get_size(self.ctx, self.first_seq + s)
            buf = (ctypes.c_uint8 * n)()
            self.lib.llama_state_seq_get_data(self.ctx, buf, n, self.first_seq + s)
            out.append(bytes(buf))
        return {"seqs": out, "pos": list(self.pos)}

    def load_state(self, state) -> None:
        for s, data in enumerate(state["seqs"]):
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            if self.lib.llama_state_seq_set_data(self.ctx, buf, len(data), self.first_seq + s) != len(data):
                raise MambaDebugError(f"{self.lib.path}: llama_state_seq_set_data failed for sequence "
                                      f"{self.first_seq + s}")
        self.pos = list(state["pos"])

    def free_step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._decode(tokens, trace=False)[0]

    # -- one decode -------------------------------------------------------------------------------
    def _decode(self, tokens: torch.Tensor, trace: bool):
        lib = self.lib
        S, T = tokens.shape
        if S != self.n_seqs:
            raise MambaDebugError(f"llama.cpp side: a ubatch of {S} sequences, the context holds {self.n_seqs}")
        b = lib.llama_batch_init(S * T, 0, 1)
        try:
            ids = tokens.tolist()
            for s in range(S):
                for j in range(T):
                    k = s * T + j
                    b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = int(ids[s][j]), self.pos[s] + j, 1, 1
                    b.seq_id[k][0] = self.first_seq + s
            b.n_tokens = S * T
            tracer = self.tracer
            if self.local is not None:          # the token axis of each node (local.LocalErrors.at_token)
                self.local.begin(self.u, self.first_seq, S, T)
            tracer.begin(trace, self.u, self.first_seq, FAULT, self.local)
            rc = lib.llama_decode(self.ctx, b)
            graphs = tracer.end()
            if tracer.error is not None or rc != 0:
                self.context_key = None         # a failed decode's context is not kept for another run (contexts.py)
            if tracer.error is not None:
                raise tracer.error
            if rc != 0:
                raise MambaDebugError(f"{lib.path}: llama_decode returned {rc} for a ubatch of {S} x {T} tokens")
            logits = np.empty((S, T, self.n_vocab), dtype=np.float32)
            for k in range(S * T):
                logits[k // T, k % T] = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, k),
                                                              shape=(self.n_vocab,))
        finally:
            lib.llama_batch_free(b)
        self.pos = [p + T for p in self.pos]
        return torch.from_numpy(logits[..., :self.cfg.vocab_size].copy()), graphs

    def _check_schedule(self, g: dict, tokens: torch.Tensor):
        S, T = tokens.shape
        want = tokens.reshape(-1).numpy().astype(np.int32)
        got = g.get("tokens")
        if got is None or g.get("shape") != (T, S) or not np.array_equal(got, want):
            raise MambaDebugError(f"llama.cpp ran another schedule than compare asked for: tokens {_short(got)} as "
                                  f"[T, S] = {g.get('shape')}, asked {_short(want)} as [{T}, {S}] (-ub "
                                  f"{self.s.ubatch}); refusing to compare")

    def _sites(self, g: dict, S: int, T: int, logits: torch.Tensor) -> dict:
        c = self.cfg
        out = {}
        for (layer, site), a in g["data"].items():
            m2 = self.kinds[layer].startswith("mamba2") if layer is not None else False
            ch = c.conv_dim if m2 else c.d_inner       # conv channels: xBC for Mamba-2, x for Mamba-1
            if site == "y_scan":
                v = a.reshape(-1)[:S * T * c.d_inner].reshape(S, T, c.d_inner)
            elif site == "conv_state":
                v = a.reshape(S, ch, c.d_conv - 1).transpose(0, 2, 1)
            elif site == "ssm_state":
                v = a.reshape(S, c.n_heads, c.head_dim, c.d_state) if m2 else a.reshape(S, c.d_inner, c.d_state)
            elif site == "GET_ROWS" and (layer is None or self.kinds[layer] != "attention"):
                v = a.reshape(S, 1, ch, c.d_conv - 1).transpose(0, 1, 3, 2).reshape(S, 1, -1)
                v = np.broadcast_to(v, (S, T, v.shape[-1]))     # the prior conv state of each sequence, every token
            elif site == "CONCAT":              # at token t: the K rows of the window the conv reads for t
                w = np.lib.stride_tricks.sliding_window_view(a.reshape(S, ch, -1), c.d_conv, axis=-1)
                v = w.transpose(0, 2, 3, 1).reshape(S, T, -1)
            else:
                v = a.reshape(S, T, -1)
            out[(layer, site)] = (torch.from_numpy(np.array(v)), site not in ("conv_state", "ssm_state"))
        out[(None, "logits")] = (logits, True)
        return out


def _replay_whole(s, reduced_weights: bool) -> bool:
    """Whether a divergence is replayed over the whole schedule (CUDA, or weights narrower than float32: the
    precision verdict needs every ubatch's local errors) or up to its own ubatch (a CPU build with f32 weights: every
    node FP32, the replay only names the node where it is born)."""
    return s.device == "cuda" or reduced_weights


def _local_device(s) -> Optional[str]:
    """Where MUL_MAT's local errors are recomputed: on the GPU for a CUDA run when torch sees one, else numpy."""
    return "cuda" if s.device == "cuda" and torch.cuda.is_available() else None


SPLIT_MODE_LAYER = 1        # LLAMA_SPLIT_MODE_LAYER


def split_array(devices: tuple, shares: Optional[tuple], lib_devices: list) -> list:
    """llama.cpp's tensor_split for --devices cuda:i,cuda:j: one float per GPU of the build (ggml's order, which
    for a CUDA build is CUDA0, CUDA1, ...), each listed GPU's share (equal by default), 0 for the others, which then
    get no layer. The array is positional, so the devices must be distinct and in ascending order."""
    gpus = [name for name, kind in lib_devices if kind in ("gpu", "igpu")]
    idx = [int(d[5:]) if d.startswith("cuda:") and d[5:].isdigit() else None for d in devices]
    if None in idx:
        raise MambaDebugError(f"--devices {','.join(devices)}: with --engine llama.cpp every device is cuda:N")
    if len(gpus) < 2 and len(devices) > 1 or any(i >= len(gpus) for i in idx):
        raise MambaDebugError(f"--devices {','.join(devices)}: this llama.cpp build sees {len(gpus)} GPU(s) "
                              f"({', '.join(gpus) or 'none'}); a split over several GPUs needs a CUDA build on a "
                              f"machine with that many")
    if idx != sorted(set(idx)):
        raise MambaDebugError(f"--devices {','.join(devices)}: with --engine llama.cpp list each GPU once, in "
                              f"ascending order (llama.cpp's tensor_split is one share per GPU, in its order)")
    out = [0.0] * len(gpus)
    for i, share in zip(idx, shares or (1.0,) * len(idx)):
        out[i] = float(share)
    return out


def layer_backends(nodes: list) -> dict:
    """{"0": ["CUDA0"], ..., "head": ["CUDA1"]}: the backend buffers the mapped nodes of each block were read
    from, i.e. the device each block really ran on."""
    out: dict = {}
    for n in nodes:
        key = "head" if n["layer"] is None else str(n["layer"])
        if n["backend"] not in out.setdefault(key, []):
            out[key].append(n["backend"])
    return out


def _fp32_everywhere(s: RunSettings) -> dict:
    """--fp32-everywhere: every switch that keeps float32 work in FP32, set before the library loads; and what has no
    switch. On a CPU build every f32 node already runs in FP32."""
    if not s.fp32_everywhere:
        return {"asked": False}
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"            # cuBLAS: FP32 instead of TF32 (read when CUDA starts)
    out = {"asked": True, "set": ["NVIDIA_TF32_OVERRIDE=0", "op_offload=false"],
           "not_switchable": ["CUDA mmf tile kernel (f32 matmuls of 4..16 columns): TF32 MMA in inline PTX, no switch"
                              "; keep -ub per sequence <= 3 to avoid it"]}
    if CUBLAS_FP32["at_init"] is False:                 # the nodes' paths say so too (local.path_of)
        out["not_applied"] = ("cuBLAS stays TF32: llama.cpp's backends started earlier in this process without "
                              "NVIDIA_TF32_OVERRIDE=0 (run --fp32-everywhere in a new process)")
    return out


def _short(a) -> str:
    if a is None:
        return "none"
    a = list(map(int, a))
    return str(a if len(a) <= 8 else a[:8] + ["..."])
