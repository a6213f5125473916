"""The traffic counter (``corelib_cuda.traffic``): what it counts as bytes and passes, checked
on operations whose traffic is known, and the targets of the cuda backend's steps on meta
tensors at the real vocabulary (B = 8 requests, V = 128256)."""

from __future__ import annotations

import pytest
import torch

from corelib_cuda.traffic import count, measure

B, V = 4, 1000


def test_elementwise_reductions_views_and_gathers():
    x = torch.zeros((B, V), device="meta")
    t = count(lambda: x * 2.0, B, V)
    assert (t.passes, t.read, t.written) == (1, 4 * B * V, 4 * B * V)
    t = count(lambda: x.view(V, B).t().reshape(B, V)[:, :10], B, V)     # views move nothing
    assert (t.passes, t.moved) == (0, 0)
    t = count(lambda: x.amax(dim=-1), B, V)
    assert (t.passes, t.read, t.written) == (1, 4 * B * V, 4 * B)
    column = torch.zeros((B, 1), device="meta")
    t = count(lambda: x + column.expand(B, V), B, V)                      # a broadcast side: B elements
    assert (t.passes, t.read) == (1, 4 * B * V + 4 * B)
    index = torch.zeros((B, 1), dtype=torch.long, device="meta")
    t = count(lambda: x.gather(1, index), B, V)
    assert (t.passes, t.read, t.written) == (0, 4 * B + 8 * B, 4 * B)
    t = count(lambda: x.add_(1.0), B, V)                                   # in place: read and written
    assert (t.passes, t.read, t.written) == (1, 4 * B * V, 4 * B * V)
    out = torch.empty((B, V), device="meta")
    t = count(lambda: torch.add(x, x, out=out), B, V)                      # out=: written, not read
    assert (t.passes, t.read, t.written) == (1, 8 * B * V, 4 * B * V)


def test_sorts_of_the_vocabulary_are_counted_and_small_top_k_is_not():
    x = torch.zeros((B, V), device="meta")
    assert count(lambda: torch.sort(x, dim=-1), B, V).sorts == 1
    assert count(lambda: torch.topk(x, 50, dim=-1), B, V).sorts == 0
    assert count(lambda: torch.topk(x, V // 2, dim=-1), B, V).sorts == 1


def test_an_in_place_scatter_writes_only_where_its_index_points():
    counts = torch.zeros((B, V), dtype=torch.int32, device="meta")
    index = torch.zeros((B, 3), dtype=torch.long, device="meta")
    ones = torch.ones((B, 3), dtype=torch.int32, device="meta")
    t = count(lambda: counts.scatter_add_(1, index, ones), B, V)
    assert (t.passes, t.read, t.written) == (0, 8 * 3 * B + 4 * 3 * B, 4 * 3 * B)
