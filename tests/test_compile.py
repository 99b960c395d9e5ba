"""-t compile: Inductor run for real on the CPU against the trace of the same blocks compiled under fake tensors."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memfit.core.errors import MemfitError
from memfit.estimators import estimate
from memfit.estimators.stand_ins import _fused_nodes
from memfit.measurement import measure
from memfit.specs.hardware import get_gpu
from memfit.specs.workload import Workload
from tests.conftest import SHAPE, rel, shape_for


def test_a_pointwise_chain_is_fused_up_to_what_leaves_it():
    """Only the cast that feeds the matmul (an unfused op) is materialised; the upcast, square and add before it
    stay in the kernel, and the matmul's output is a buffer of its own."""
    def f(x, w):
        return (x.float().pow(2) + 1).to(torch.bfloat16) @ w

    graph = make_fx(f)(torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 2, dtype=torch.bfloat16)).graph
    fused = _fused_nodes(graph)
    ops = [(str(n.target).split(".")[1], n in fused) for n in graph.nodes if n.op == "call_function"]
    assert ops == [("_to_copy", True), ("pow", True), ("add", True), ("_to_copy", False), ("mm", False)]


def test_a_view_of_a_fused_result_and_a_gather_stay_in_the_kernel():
    """Cross-entropy's pattern: a pointwise result read through a view by a gather, summed. Inductor loads the
    gathered elements inside the kernel: only the sum leaves it."""
    def f(x, index):
        return torch.gather((x.float() * 2).view(4, 8), 1, index).sum()

    graph = make_fx(f)(torch.ones(32, dtype=torch.bfloat16), torch.zeros(4, 1, dtype=torch.int64)).graph
    fused = _fused_nodes(graph)
    ops = [(str(n.target).split(".")[1], n in fused) for n in graph.nodes if n.op == "call_function"]
    assert ops == [("_to_copy", True), ("mul", True), ("view", True), ("gather", True), ("sum", False)]


def test_torchtunes_chunked_loss_compiles_its_slices(measured):
    """chunked-ce:mode=upcast under -t compile compiles each slice's upcast and cross-entropy, as torchtune does:
    backward keeps the slices' logits and not their float32 log-probabilities; the trace within 5 % of the run."""
    run = measure(Workload(**SHAPE, techniques=("chunked-ce:mode=upcast", "compile")), estimates=("traced",))
    assert rel(run.extra["estimates"]["traced"]["peak_bytes"], run.peak_bytes) < 0.05
    assert run.peak_bytes < 0.9 * measured(("chunked-ce:mode=upcast",)).peak_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_compiled_blocks_traced_as_inductor_runs_them(precision):
    """Inductor's C++ backend runs the compiled blocks for real; the trace (Inductor's partitioner under fake
    tensors, fused intermediates not counted) is within 5 % of its peak, and compiling lowers the peak."""
    shape = shape_for((precision,))
    workload = Workload(**shape, precision=precision, techniques=("compile",))
    run = measure(workload, estimates=("traced",))
    assert rel(run.extra["estimates"]["traced"]["peak_bytes"], run.peak_bytes) < 0.05
    eager = estimate(Workload(**shape, precision=precision), method="traced")
    assert run.peak_bytes < 0.95 * eager.peak_bytes, (run.peak_bytes, eager.peak_bytes)


def test_compiled_blocks_with_dropout_traced_as_inductor_runs_them():
    """Dropout's random seeds go through Inductor's replace_random pass, which reads the fake mode compile_fx installs
    (a traceback in the trace before): GPT-2's blocks, compiled and run for real, to the bytes of a few scalars."""
    run = measure(Workload(model="tiny-gpt2", seq_len=32, batch_size=2, techniques=("compile",)), estimates=("traced",))
    assert rel(run.extra["estimates"]["traced"]["peak_bytes"], run.peak_bytes) < 0.001


def test_compile_under_selective_checkpointing_is_refused():
    with pytest.raises(MemfitError, match="falls back to eager"):
        estimate(Workload(**SHAPE, techniques=("compile", "checkpointing:mode=selective")), method="traced")


def test_the_analytic_model_refuses_compile_and_says_what_to_use():
    with pytest.raises(MemfitError, match="--method traced"):
        estimate(Workload(**SHAPE, techniques=("compile",)), method="analytic")


def test_compiled_blocks_on_a_gpu_target_stay_whole_graphs():
    """On a GPU target the autocast and SDPA emulation run inside each compiled block: no graph break splits it (the
    partitioner sees the whole layer, as Inductor does on the GPU), and estimates made one after another never reach
    Dynamo's recompile limit, past which it runs the blocks eager."""
    from torch._dynamo.utils import counters

    counters.clear()
    workload = Workload(**SHAPE, precision="bf16-mixed", techniques=("compile",))
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        peaks = {estimate(workload, method="traced", gpu=get_gpu("a100-80gb")).peak_bytes for _ in range(4)}
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(peaks) == 1


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "tensor-parallel", "pipeline-parallel"])
def test_compiled_blocks_trace_beside_every_distributed_layout(layout):
    """-t compile beside a layout over 2 ranks traces (DDP's graph splitting at bucket boundaries was a Dynamo
    traceback: issue 39): each block is compiled whole, and compiling only changes what the block keeps."""
    shape = dict(SHAPE, world_size=2, batch_size=2)
    plain = estimate(Workload(**shape, techniques=(layout,)), method="traced")
    compiled = estimate(Workload(**shape, techniques=(layout, "compile")), method="traced")
    assert 0 < compiled.peak_bytes < plain.peak_bytes
    assert compiled.model_state_bytes == plain.model_state_bytes
