"""The tracer's stand-ins for what techniques' libraries cannot run on fake tensors (steps/stand_ins.py is the
registry the techniques ask; this module fills it when memfit.estimators loads). Each allocates what the library
allocates in the real run, and each is pinned by a traced-vs-measured test (ARCHITECTURE.md lists them):

  peft-adapters       LoRA / QLoRA: peft moves each new adapter with Module.to, which cannot swap fake tensors
  torchao-adamw4bit   adamw4bit: torchao's compiled step reads values; its exact state layout instead
  bnb-4bit-weight     bnb-4bit / QLoRA: Params4bit cannot wrap a fake tensor; the same codes and quant state
  ddp-trace           ddp: DDP's init_sync and bucket rebuild broadcast values; the trace keeps both bucket sets
  inductor-trace      compile: Inductor's partitioner and decompositions under fake tensors, graphs run op by op
  prune-order         prune-structured: which units to remove is read off their scores, which fakes lack
"""
from __future__ import annotations

import contextlib
import functools

import torch

from memfit.core.weight_formats import BNB_BLOCK
from memfit.steps.fusion import fused
from memfit.steps.host import note_category
from memfit.steps.stand_ins import register_stand_in
from memfit.techniques.optimizer_states import BLOCK_4BIT, MIN_QUANTIZED_NUMEL, QMAP_4BIT

PEFT_ADAPTERS, TORCHAO_ADAMW4BIT, BNB_4BIT_WEIGHT = "peft-adapters", "torchao-adamw4bit", "bnb-4bit-weight"
DDP_TRACE, INDUCTOR_TRACE, PRUNE_ORDER = "ddp-trace", "inductor-trace", "prune-order"


@register_stand_in(PEFT_ADAPTERS)
@contextlib.contextmanager
def peft_adapters_on_fake_tensors():
    """peft builds each adapter on the CPU and moves it to its base layer's device and dtype with
    Module.to, which cannot swap fake tensors (a traced run's); at the end it casts half-precision
    adapters back to float32. Under fake tensors the adapters are built in float32 and a Module.to
    that changes no device returns at once, so they end as the real run's do."""
    to, default = torch.nn.Module.to, torch.get_default_dtype()

    def to_unless_moved(module, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or all(t.device.type == torch.device(device).type
                                 for t in (*module.parameters(), *module.buffers())):
            return module
        return to(module, *args, **kwargs)

    torch.nn.Module.to = to_unless_moved
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.nn.Module.to = to
        torch.set_default_dtype(default)


@register_stand_in(TORCHAO_ADAMW4BIT)
class Blockwise4bitLayout(torch.optim.Optimizer):
    """A stand-in with the exact state layout of torchao's AdamW4bit, for traces: its real step compiles and
    reads data, which FakeTensorMode forbids. The same state tensors are created at the first step as torchao
    creates them, and the update is in place. The compiled step fuses dequantize-update-quantize into one
    kernel per parameter, so no parameter-sized temporaries appear (checked against a real run in
    tests/test_techniques.py)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @staticmethod
    def _state(p: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = p.numel()
        if n >= MIN_QUANTIZED_NUMEL and n % BLOCK_4BIT == 0:
            return (torch.zeros(n // 2, dtype=torch.uint8), torch.zeros(n // BLOCK_4BIT), torch.zeros(QMAP_4BIT))
        return (torch.zeros_like(p),)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in ("exp_avg", "exp_avg_sq"):
                        for i, tensor in enumerate(self._state(p)):
                            state[f"{name}.{i}"] = tensor
                state["step"] += 1
                p.add_(p.grad, alpha=0.0)


@register_stand_in(BNB_4BIT_WEIGHT)
def bnb_4bit_weight(linear, weight: torch.Tensor, *, quant_type: str, double_quant: bool) -> None:
    """`linear.weight` as the 4-bit codes and quant state Params4bit would hold (what peft reads of it)."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():   # bitsandbytes caches its code books per device: real ones
        probe = torch.ones(2, BNB_BLOCK, device=weight.device)
        dequantize_4bit(*quantize_4bit(probe, compress_statistics=double_quant, quant_type=quant_type))
    codes, state = quantize_4bit(weight.data, compress_statistics=double_quant, quant_type=quant_type)
    linear.weight = torch.nn.Parameter(codes, requires_grad=False)
    for key, value in dict(quant_state=state, quant_type=quant_type, compress_statistics=double_quant,
                           blocksize=state.blocksize, quant_storage=torch.uint8).items():
        setattr(linear.weight, key, value)


@register_stand_in(DDP_TRACE)
def traced_ddp(model: torch.nn.Module, *, bucket_view: bool) -> torch.nn.Module:
    """DDP without init_sync (it checks every rank's shapes and broadcasts rank 0's weights: values a trace does not
    have), its all-reduce completing at once, and its bucket rebuild allocated where the real one allocates it."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view, init_sync=False)
    wrapped.register_comm_hook(None, _traced_all_reduce)
    wrapped.reducer = _KeepBuckets(wrapped.reducer, list(wrapped.parameters()))
    return wrapped


def _traced_all_reduce(_state, bucket):
    """A trace's fake process group completes with no value: the bucket comes back as it is."""
    note_category([bucket.buffer()], "gradients")
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class _KeepBuckets:
    """A trace's DDP reducer. The real one rebuilds its buckets in gradient order at the second forward,
    which broadcasts bucket indices (values a trace does not have), and holds the old and the new
    buckets through that step (measured on 2 gloo ranks: +1x the gradients' bytes; later steps hold one
    set). The trace keeps the first buckets and allocates the second set where the real one does."""

    def __init__(self, reducer, params: list) -> None:
        self._reducer, self._params, self._forwards = reducer, params, 0
        self.rebuilt: torch.Tensor | None = None

    def _rebuild_buckets(self) -> bool:
        self._forwards += 1
        if self._forwards == 2:
            nbytes = sum(p.numel() * p.element_size() for p in self._params if p.requires_grad)
            self.rebuilt = torch.empty(nbytes, dtype=torch.uint8, device=self._params[0].device)
            note_category([self.rebuilt], "gradients")
        return False

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)


@register_stand_in(INDUCTOR_TRACE)
def compile_for_trace(function):
    """`function` compiled with Inductor's decompositions and partitioner, its graphs run op by op."""
    compiled = torch.compile(function, backend=_traced_backend())
    return functools.partial(_recompiled_as_needed, compiled)


def _recompiled_as_needed(call, *args, **kwargs):
    """A compiled block in a trace, compiled again whenever its guards fail (a KV cache's layer index, a new decode
    length) rather than run eager past Dynamo's recompile_limit of 8: a trace is the compiled step, not the fallback.
    Inside DistributedDataParallel's forward, Dynamo's DDPOptimizer would split each compiled graph at the gradient
    buckets' boundaries, compiling the pieces on fake tensors of a mode of its own, which the trace's cannot enter
    (an InternalTorchDynamoError): the trace compiles each block whole (optimize_ddp off), which splits nothing a
    block smaller than a bucket (25 MiB of gradients) would; a bigger block's split is not modelled. Under a process
    group each shape gets graphs of its own (no automatic dynamic shapes): a process that estimates many shapes (the
    planner, a notebook) traces each as a fresh process would, where symbolic sizes through DTensor recursed without
    end. On one device Dynamo's default stands: a generation's decode steps share one graph dynamic in the cache's
    length after the second (one static graph per step compiled a 100-token generation a hundred times)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    with torch._dynamo.config.patch(recompile_limit=1024, accumulated_recompile_limit=1024 * 64, optimize_ddp=False,
                                    automatic_dynamic_shapes=not distributed):
        return call(*args, **kwargs)


# ops Inductor lowers to loops it can fuse with their neighbours, besides those tagged pointwise or reduction
# (gather: a pointwise loop that loads its input at the gathered indices)
_ALSO_FUSED = {"aten._to_copy.default", "aten.clone.default", "aten.gather.default"}


def _traced_backend():
    """AOTAutograd with Inductor's decompositions and partitioner, its graphs run op by op (`_run_fused`)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint, joint_inputs, **kwargs):
        # Inductor's passes (dropout's random seeds: replace_random) read the fake mode compile_fx would install
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return partition_fn(joint, joint_inputs, **kwargs)

    return aot_autograd(fw_compiler=_run_fused, bw_compiler=_run_fused, partition_fn=partition,
                        decompositions=select_decomp_table())


def _run_fused(gm: torch.fx.GraphModule, example_inputs):
    """The graph as a boxed function that runs its nodes in order, each fused node inside `fused()`."""
    from functorch.compile import make_boxed_func

    in_kernel = _fused_nodes(gm.graph)

    class Runner(torch.fx.Interpreter):
        def run_node(self, node):
            if node in in_kernel:
                with fused():
                    return super().run_node(node)
            return super().run_node(node)

    return make_boxed_func(lambda *args: Runner(gm).run(*args))


def _fusible(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return (torch.Tag.pointwise in target.tags or torch.Tag.reduction in target.tags
            or str(target) in _ALSO_FUSED)


def _consumers(node: torch.fx.Node):
    """The nodes that read `node`'s memory, through views of it."""
    for user in node.users:
        if _is_view(user):
            yield from _consumers(user)
        else:
            yield user


def _fused_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Pointwise ops and reductions whose every consumer is one too: Inductor keeps their results in a kernel;
    and the views of those results, which the consumers read through."""
    fused = {node for node in graph.nodes
             if _fusible(node) and all(_fusible(user) for user in _consumers(node))}
    for node in graph.nodes:   # in order: a view of a view of a fused result comes after the first view
        if _is_view(node) and node.args and node.args[0] in fused:
            fused.add(node)
    return fused


def _is_view(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


@register_stand_in(PRUNE_ORDER)
def prune_in_order(scores: torch.Tensor, keep: int) -> list[int]:
    """The units to remove under fake tensors, whose scores have no values: all but the first `keep` (the shapes are
    the same whichever go)."""
    return list(range(keep, scores.numel()))
