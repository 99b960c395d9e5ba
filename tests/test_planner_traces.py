"""What keeps planning a custom model fast: traces read off at other micro-batches, a depth check made once per
workload, allocator settings that reuse a trace, and candidates sized on every core: each gives the figures a
fresh trace (or one process) gives."""
import textwrap

import pytest

from memfit.estimators.traced import reusing_traces, traced_estimate
from memfit.planner.parallel import forked
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload

A100 = get_gpu("a100-80gb")

PAIRWISE = """
import torch
from torch import nn

class Pairwise(nn.Module):   # a contrastive head: a (batch x batch) score matrix, quadratic in the micro-batch
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, tokens):
        x = self.emb(tokens).mean(1)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x @ x.T

def build():
    return Pairwise()

def tokens(batch_size, seq_len):
    return torch.randint(0, 100, (batch_size, seq_len))
"""


def _figures(estimate):
    return (estimate.peak_bytes, estimate.at_peak, estimate.component_peaks, estimate.host_bytes,
            estimate.paged_bytes, estimate.reserved_bytes, estimate.overhead_bytes)


@pytest.mark.parametrize("settings", [
    dict(model="memfit.examples.custom_decoder:build_7b", inputs="memfit.examples.custom_decoder:make_inputs",
         seq_len=2048, precision="bf16-mixed"),
    dict(model="tiny-llama", seq_len=128, precision="bf16-mixed", optimizer="paged-adamw8bit",
         techniques=("checkpointing:mode=offload",)),
    dict(model="tiny-llama", seq_len=128, techniques=("cpu-offload",)),
], ids=["custom-7b", "tiny-llama-offloaded-activations", "tiny-llama-cpu-offload"])
def test_a_micro_batch_read_off_two_traces_is_the_trace(settings):
    """Traced at micro-batches 2 and 4, the step at 8 is read off them (every allocation the same or in proportion),
    its line in depth checked at 2 only; the figures are a fresh trace's at 8, byte for byte, the allocator's too;
    expandable segments reuse the traces and replay them through their own allocator."""
    def at(batch, *extra):
        return Workload(task="train", batch_size=batch, **{**settings, "techniques": settings.get("techniques", ())
                                                           + extra})

    with reusing_traces():
        first = traced_estimate(at(2), A100)
        second = traced_estimate(at(4), A100)
        read = traced_estimate(at(8), A100)
        expandable = traced_estimate(at(8, "expandable-segments"), A100)
    if any("extrapolated" in n for n in first.notes):   # the custom 7B's 32 blocks (tiny-llama's 4 are all traced)
        assert any("checked exactly on a third depth at micro-batch 2" in n for n in second.notes)
    assert any("read off the traces at micro-batches 2 and 4" in n for n in read.notes)
    assert _figures(second) == _figures(traced_estimate(at(4), A100))
    assert _figures(read) == _figures(traced_estimate(at(8), A100))
    assert _figures(expandable) == _figures(traced_estimate(at(8, "expandable-segments"), A100))


def test_an_allocation_that_grows_otherwise_is_traced(tmp_path, monkeypatch):
    """A (batch x batch) score matrix is neither constant nor in proportion to the micro-batch: the step is traced."""
    (tmp_path / "pairwise.py").write_text(textwrap.dedent(PAIRWISE))
    monkeypatch.chdir(tmp_path)

    def at(batch):
        return Workload(model="./pairwise.py:build", inputs="./pairwise.py:tokens", task="train", batch_size=batch,
                        seq_len=16)

    with reusing_traces():
        traced_estimate(at(2), A100)
        traced_estimate(at(4), A100)
        third = traced_estimate(at(8), A100)
    assert not any("read off" in n for n in third.notes)
    assert _figures(third) == _figures(traced_estimate(at(8), A100))


def test_work_forked_to_every_core_comes_back_in_order(monkeypatch):
    """forked(): each item's result, asked for in order, whichever worker computed it (and the job's own answer where
    there is one core)."""
    from memfit.planner import parallel

    squares = [i * i for i in range(7)]
    for cores in (2, 1):
        monkeypatch.setattr(parallel, "usable_cores", lambda cores=cores: cores)
        with forked(lambda i: squares[i], len(squares)) as result:
            assert [result(i) for i in range(len(squares))] == squares


def test_candidates_sized_on_every_core_are_sized_as_in_one_process(monkeypatch):
    """sizing(): the workers' sizings, read in the search's order, are one process's, and their estimates and
    refusals join the search's."""
    from memfit.planner import parallel
    from memfit.planner.request import PlanRequest
    from memfit.planner.search import Search

    # 108 candidates, 11 refused (a lossy search has 812: the same code paths, eight times the minute)
    request = PlanRequest(model="tiny-llama", gpu=get_gpu("t4"), seq_len=256, global_batch=4)

    def sized(cores):
        monkeypatch.setattr(parallel, "usable_cores", lambda: cores)
        search = Search(request)
        items = search.workloads()
        with parallel.sizing(search, items) as size:
            results = [size(i) for i in range(len(items))]
        return [(r.techniques, r.micro_batch, r.device_bytes, r.fits) for r in results if r], search

    (forked_sizings, forked_search), (own_sizings, own_search) = sized(2), sized(1)
    assert len(forked_sizings) > 20 and forked_sizings == own_sizings and own_search.rejected
    assert forked_search.estimated.keys() == own_search.estimated.keys()
    assert forked_search.num_estimates == own_search.num_estimates and forked_search.rejected == own_search.rejected
