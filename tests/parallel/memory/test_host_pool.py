"""The host pool under activation offloading (`ndparallel.parallel.memory.host_pool`): offloaded tensors' host copies
are carved from blocks kept step after step, so the pool allocates in the first step only and holds the sum of a
step's tensors (in whole pages), not each rounded up to a power of two as torch's caching host allocator pins them
(`planner.offload.pinned`). On CPU, ``copy=True`` sends every offloaded tensor through the pool in ordinary memory
(the code path of CUDA's pinned blocks but for the copy streams and their events, which a GPU run exercises)."""

from __future__ import annotations

import copy

import torch
from torch.distributed._composable import checkpoint

from ndparallel.parallel.memory.host_pool import ALIGN, HostPool, aligned
from ndparallel.parallel.memory.offload import ActivationOffload, offload_block_inputs
from ndparallel.planner.offload import pinned
from tiny_models import build_model

LAYERS = 4


def _models() -> tuple[torch.nn.Module, torch.nn.Module, ActivationOffload]:
    torch.manual_seed(0)
    model = build_model("llama", num_hidden_layers=LAYERS)
    own = copy.deepcopy(model)
    for layer in (*model.model.layers, *own.model.layers):
        checkpoint(layer)
    offload = ActivationOffload(torch.device("cpu"), copy=True)
    offload_block_inputs(list(model.model.layers), offload)
    return model, own, offload


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> list[torch.Tensor]:
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    return grads


def test_the_pool_allocates_in_the_first_step_only_holds_the_sum_and_restores_exactly():
    model, own, offload = _models()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, own)]
    shape = (3, 48, 32)  # batch x tokens x hidden, fp32: 18,432 B per layer input, which a pinned block rounds to 32,768
    nbytes = 3 * 48 * 32 * 4
    allocations = []
    for step in range(3):
        ids = torch.randint(0, 96, shape[:2], generator=torch.Generator().manual_seed(step))
        grads, grads_own = (_step(m, opt, ids) for m, opt in zip((model, own), optimizers))
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_own)), step  # bit for bit, every step
        allocations.append(offload.pool.stats.allocations)
    stats = offload.pool.stats
    assert offload.stats.shapes == [shape] * LAYERS * 3 and offload.stats.restored == LAYERS * 3
    assert allocations == [LAYERS] * 3  # one block per layer input in step 1, none after
    assert aligned(nbytes) == 5 * ALIGN == 20_480  # the tensor's bytes in whole pages
    assert stats.peak_held == stats.held == LAYERS * aligned(nbytes)  # the sum, in pages
    assert stats.peak_in_use == stats.peak_held and stats.in_use == 0  # all given back after backward
    assert stats.peak_held < LAYERS * pinned(nbytes) == LAYERS * 32_768  # one pinned block per tensor


def test_a_block_is_handed_out_again_only_once_given_back():
    pool = HostPool(pin=False)
    a, b = pool.acquire(1000), pool.acquire(1000)
    assert a is not b and a.size == b.size == aligned(1000) == ALIGN
    c = pool.acquire(ALIGN + 1)
    pool.release(a)
    assert pool.acquire(1000) is a  # the free block of its size
    assert pool.acquire(1000) not in (a, b, c)  # b is still out: a new block
    assert pool.stats.allocations == 4 and pool.stats.held == 3 * ALIGN + 2 * ALIGN
    view = a.view(torch.Size([2, 3]), torch.float64)  # a tensor over the block's first bytes
    view.copy_(torch.arange(6.0).view(2, 3))
    assert view.data_ptr() == a.memory.data_ptr() and view.data_ptr() % ALIGN == 0


def test_blocks_of_a_graph_dropped_without_backward_go_back_to_the_pool():
    model, _, offload = _models()
    ids = torch.randint(0, 96, (2, 16))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert offload.pool.stats.in_use == LAYERS * aligned(2 * 16 * 32 * 4)
    del loss  # the graph and its saved-tensor handles go: their blocks come back
    assert offload.pool.stats.in_use == 0
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert offload.pool.stats.allocations == LAYERS  # the second forward reused them


def test_blocks_a_whole_cycle_left_unused_are_let_go():
    """A step of other shapes takes new blocks; at its end (no block out) the previous shape's blocks, unused the
    whole cycle, go back to the system: the pool holds what recent steps used, not every shape seen."""
    model, _, offload = _models()
    for tokens in (16, 40):  # 4,096 and 10,240 B per layer input: 1 and 3 pages
        ids = torch.randint(0, 96, (2, tokens))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    stats = offload.pool.stats
    assert stats.allocations == 2 * LAYERS and stats.released == LAYERS
    assert stats.held == LAYERS * 3 * ALIGN and stats.peak_held == LAYERS * (1 + 3) * ALIGN
