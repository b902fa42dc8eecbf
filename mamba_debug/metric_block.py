"""A launch group's metrics in one float64 block; each site's four [S, T] views made only when they are read.

The fused metrics kernel (`_site_metrics.py`) writes the metrics of a layer's sites into one result block, site
after site, each as [4, S, T] rows in `METRICS` order. Cutting that block into four views a site as it is measured
cost most of the host time of measuring at birth (235 of 287 us for a layer's 15 sites on the 2-core CPU machine;
on the H200's host 0.1-0.2 s of a 2.8B prefill, time a traced run spends between the GPU's launches). A
`SiteErrors` is the mapping metric -> [S, T] tensor that makes its views at the first read, and `errors_cpu` joins
one site's ubatches on the host, moving each block there once instead of one transfer per site and metric.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

METRICS = ("rel_l2", "max_abs", "nmse", "cosine")   # the rows of a site's [4, S, T] piece (as metrics.METRICS)


class SiteErrors(Mapping):
    """One site's `site_errors`: rows offset .. offset + 4 S T of `block`, a [S, T] float64 tensor per metric."""

    __slots__ = ("block", "offset", "shape", "_views")

    def __init__(self, block: torch.Tensor, offset: int, shape: tuple):
        self.block, self.offset, self.shape, self._views = block, offset, shape, None

    def __getitem__(self, metric: str) -> torch.Tensor:
        if self._views is None:
            n = 4 * self.shape[0] * self.shape[1]
            self._views = dict(zip(METRICS, self.block[self.offset:self.offset + n].view(4, *self.shape).unbind(0)))
        return self._views[metric]

    def __iter__(self):
        return iter(METRICS)

    def __len__(self) -> int:
        return len(METRICS)

    def on_host(self, blocks: dict) -> np.ndarray:
        """The [4, S, T] piece as a numpy view of this block's host copy (`blocks`: id -> (block, host copy),
        filled on first use, so each block crosses once)."""
        kept = blocks.get(id(self.block))
        if kept is None:
            kept = blocks[id(self.block)] = (self.block, self.block.cpu().numpy())   # the block, so its id stays
        n = 4 * self.shape[0] * self.shape[1]
        return kept[1][self.offset:self.offset + n].reshape(4, *self.shape)


def cat_cpu(chunks: list) -> torch.Tensor:
    """[S, t] metric chunks of the ubatches, on the reference's device -> one [S, n_tok] CPU tensor."""
    return torch.cat(chunks, 1).cpu()


def errors_cpu(chunks: list, blocks: dict) -> dict:
    """One site's metrics over its ubatches (a mapping metric -> [S, t] each) -> metric -> one [S, n_tok] CPU
    tensor, the same values as `cat_cpu` of each metric. Chunks that are all `SiteErrors` are joined from their
    blocks' host copies (`blocks`, shared by every site of a run); others as `cat_cpu` joins them."""
    if not all(isinstance(c, SiteErrors) for c in chunks):
        return {m: cat_cpu([c[m] for c in chunks]) for m in chunks[0]}
    pieces = [c.on_host(blocks) for c in chunks]
    return {m: torch.from_numpy(np.concatenate([p[i] for p in pieces], 1)) for i, m in enumerate(METRICS)}
