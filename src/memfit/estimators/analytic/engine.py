"""A symbolic autograd: tensors are (numel, dtype), ops follow PyTorch's save rules, and CPython's
reference counting frees them when the program lets go, as PyTorch's does.

The analytic estimator writes each model family as a short program over these symbols, mirroring
the Hugging Face forward code. Running it gives every allocation in closed form: what autograd saves
(activations), what backward allocates (temporaries, gradients), and when each is freed. Nothing is
a tensor; a 405B model costs the same microseconds as a tiny one.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

from memfit.core.caching_allocator import PHASE_START, Event
from memfit.core.categories import CATEGORIES, zero_categories
from memfit.core.kv_caches import KVCacheKind, kv_cache_kind
from memfit.estimators.analytic import recompute
from memfit.estimators.analytic.blocks import Gathers, block_numels, block_of
from memfit.estimators.analytic.recompute import RecomputeDone, Region
from memfit.estimators.analytic.symbols import Alias, Offloaded, Param, Sym, is_parameter

T = TypeVar("T")


@dataclass(frozen=True)
class Policy:
    """How the run executes: which dtypes, which device's kernels and autocast lists."""

    param_dtype: str            # "float32" | "bfloat16"
    autocast_dtype: str | None  # "bfloat16" | "float16" | None
    backend: str                # "cpu" | "cuda"
    train: bool
    capability: tuple[int, int] = (8, 0)   # the GPU's compute capability: which attention kernels exist
    attention_kernel: str | None = None    # the SDPA kernel the model's attention is run as (None: PyTorch's choice)
    round_to: int = 1           # allocator granularity (CUDA caching allocator: 512 bytes)
    checkpoint_every: int = 0   # activation checkpointing of blocks 0, n, 2n, ... (0: none)
    checkpoint_selective: str | None = None   # "selective": keep every matmul and attention output; "selective-op":
    #                                           torchtitan's op policy (recompute.Region.keeps)
    loss_chunks: int = 0        # chunked cross-entropy: LM head + loss over this many sequence slices
    loss_logits_kept: bool = False   # chunked-ce:mode=upcast: every slice's logits kept, not recomputed
    fsdp: bool = False          # FSDP2: each block's parameters all-gathered while it runs (blocks.py)
    fsdp_reshard: bool = True   # FSDP2 frees a block's gathered parameters after its forward (else after backward)
    state_dtype: str | None = None   # FSDP2's MixedPrecisionPolicy: parameter shards, gradients and optimizer states
    #                                  in this dtype, gathered (and computed with) in param_dtype; gradients are
    #                                  reduced in it
    grads_leave: bool = False   # each gradient is freed once accumulated: copied to the host (cpu-offload) or
    #                             into DDP's buckets (ddp:bucket_view=true)
    checkpoint_offload: bool = False   # checkpointing:mode=offload: the blocks' saved tensors go to the host
    stream_blocks: bool = False  # stream-layers: block weights live on the host, copied in while a block runs
    master_dtype: str | None = None   # the optimizer steps on master copies of the weights in this dtype (bf16-master):
    #                                   its states and temporaries in it
    grad_bucket: int = 0        # DeepSpeed ZeRO-1/2: a reduction bucket of this many elements, allocated when
    #                             the first gradient arrives and kept
    kv_cache: str = "dynamic"   # how decoding caches keys and values: a KV-cache kind (core/kv_caches.py)

    @property
    def kv_cache_kind(self) -> KVCacheKind:
        return kv_cache_kind(self.kv_cache)


@dataclass
class Node:
    """A backward function. Like autograd's, it refers to its output and inputs by identity and
    shape only; the tensors it keeps alive are exactly the ones it saved."""

    output: int                       # uid of the output
    inputs: list                      # (uid, numel, dtype, Param | None) of inputs needing a gradient
    saved: list = field(default_factory=list)     # Syms kept for backward
    segment: object = None
    scratch: list = field(default_factory=list)   # (numel, dtype) allocated and freed inside backward
    passthrough: bool = False                     # input gradients alias the output gradient
    region: Region | None = None                  # the checkpointed block that recorded this node
    carries: list = field(default_factory=list)   # (key, numel, dtype) allocated as it runs, held until a later
    #                                               node's `drops` names the key (what a checkpoint recomputes)
    drops: list = field(default_factory=list)     # keys of such tensors freed as it runs


@dataclass
class PeakPoint:
    total: int
    at: dict[str, int]


class Engine:
    def __init__(self, policy: Policy, weights: dict[str, int] | None = None) -> None:
        """`weights`: per-category multipliers for sharded per-rank accounting (see sharding.py); the
        peaks recorded are of the weighted totals."""
        self.policy = policy
        self.weights = weights or {name: 1 for name in CATEGORIES}
        self.live = zero_categories()
        self.total = 0
        self.phase = "setup"
        self.segment: object = "pre"
        self.peaks: dict[tuple[str, object], PeakPoint] = {}
        self.category_max: dict[tuple[str, object], dict[str, int]] = {}
        self.tape: list[Node] = []
        self.params: dict[str, Param] = {}
        self.cast_cache: dict[str, Sym] = {}
        self.autocast_on = policy.autocast_dtype is not None
        self.keep: list = []          # tensors the program holds across calls (inputs, caches)
        # set to [] to record the device's allocations in order: (tensor uid, weighted bytes it holds from now on)
        self.allocations: list[Event] | None = None
        self.stream: object = 0       # the CUDA stream new tensors are allocated on (FSDP2's own streams: blocks.py)
        self.inputs_are_views = False
        self.region: Region | None = None         # the checkpointed block being run, if any
        self.gathers = Gathers(self) if policy.fsdp else None   # FSDP2's all-gathers (blocks.py)
        self.rerun_left: int | None = None       # saving nodes still to record in a re-run
        self.offloading: dict[int, Offloaded] | None = None   # in an offloaded block: its host copies by uid
        self.host_live = 0
        self.host_peak = 0
        self.paged_bytes = 0          # CUDA unified memory: a paged optimizer's states (optimizer.create_states)
        self._bucket: Sym | None = None
        self.carried: dict[object, Sym] = {}   # what backward nodes carry to later ones (Node.carries)
        self._block_numels: dict[object, int] | None = None
        # called with a parameter once its gradient is complete (an optimizer step in backward: optimizer.py)
        self.gradient_ready: Callable[[Param], None] | None = None

    # ---- accounting ------------------------------------------------------------------------
    def _account(self, sym: Sym, sign: int) -> None:
        nbytes = sym.nbytes * self.weights[sym.category]
        self.live[sym.category] += sign * nbytes
        self.total += sign * nbytes
        if self.allocations is not None:
            self.allocations.append((sym.uid, nbytes if sign > 0 else 0, self.stream))
        if sign > 0:
            self._observe(sym.category)

    def recategorize(self, sym: Sym, category: str) -> None:
        """The same tensor counted under another category from now on (no allocation)."""
        recording, self.allocations = self.allocations, None
        self._account(sym, -1)
        sym.category = category
        self._account(sym, +1)
        self.allocations = recording

    def _host(self, nbytes: int) -> None:
        self.host_live += nbytes
        self.host_peak = max(self.host_peak, self.host_live)

    def _observe(self, category: str | None = None) -> None:
        key = (self.phase, self.segment)
        point = self.peaks.get(key)
        if point is None or self.total > point.total:
            self.peaks[key] = PeakPoint(self.total, dict(self.live))
        cmax = self.category_max.get(key)
        if cmax is None:
            cmax = self.category_max[key] = dict(self.live)
        elif category is not None:
            if self.live[category] > cmax[category]:
                cmax[category] = self.live[category]
        else:
            for name, value in self.live.items():
                if value > cmax[name]:
                    cmax[name] = value

    def set_phase(self, phase: str, segment: object = "pre") -> None:
        if self.gathers and self.phase == "forward" and phase != "forward":
            self.gathers.end_forward()
        if self.allocations is not None and phase != self.phase:
            self.allocations.append((PHASE_START, 0, 0))
        self.phase, self.segment = phase, segment
        if self.gathers and phase == "forward":
            self.gathers.begin_forward()
        self._observe()

    @contextlib.contextmanager
    def on_stream(self, stream: object):
        """Allocate on `stream` inside (the caching allocator keeps a pool per stream)."""
        previous, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = previous

    # ---- streamed blocks --------------------------------------------------------------------
    def stream_from_host(self) -> None:
        """stream-layers: the blocks' declared weights move to host RAM (counted there, not on the device)."""
        for name, param in self.params.items():
            if block_of(name) is not None and param.counted:
                self._account(param, -1)
                param.counted = False
                self._host(param.nbytes)

    # ---- creating symbols ------------------------------------------------------------------
    def param(self, name: str, shape: tuple[int, ...], trainable: bool = True, dtype: str | None = None) -> Param:
        """`dtype`: one the model keeps whatever the precision (DeepSeek's router weight: float32)."""
        if name not in self.params:
            numel = 1
            for size in shape:
                numel *= size
            param = Param(self, name, numel, dtype or self.policy.param_dtype, trainable and self.policy.train,
                          self.policy.state_dtype)
            param.shape = tuple(shape)
            self.params[name] = param
        return self.params[name]

    def new(self, numel: int, dtype: str, grad: bool = False, category: str | None = None) -> Sym:
        if category is None:
            category = "activations" if self.phase in ("forward", "prefill", "decode") else "temporaries"
        return Sym(self, numel, dtype, grad and self.policy.train, category)

    def input(self, numel: int, dtype: str) -> Sym:
        """A tensor of the batch: alive for the whole step. With `inputs_are_views` the batch was declared
        whole beforehand and the program sees views of it (a truncated or windowed sequence)."""
        if self.inputs_are_views:
            return Sym(self, numel, dtype, False, "inputs", counted=False)
        sym = self.new(numel, dtype, category="inputs")
        self.keep.append(sym)
        return sym

    def record(self, output: Sym, inputs: list, saved: list, scratch: list | None = None,
               grad_dtypes: list | None = None, passthrough: bool = False) -> Sym:
        """Register an op for backward when any input needs a gradient."""
        needs = [x for x in inputs if isinstance(x, Sym) and x.grad]
        if self.policy.train and needs:
            output.grad = True
            dtypes = grad_dtypes or [x.dtype for x in needs]
            edges = [(x.uid, x.numel, dtype, x if isinstance(x, Param) else None) for x, dtype in zip(needs, dtypes)]
            self.add_node(output.uid, edges, saved, scratch or [], passthrough)
        return output

    def add_node(self, output: int, edges: list, saved: list, scratch: list, passthrough: bool = False,
                 carries: list | None = None, drops: list | None = None) -> None:
        """A backward node with its edges given: (input uid, gradient numel, dtype, Param | None) each."""
        kept: list[Sym | Offloaded] = [s for s in saved if isinstance(s, Sym)]
        if self.offloading is not None:   # the pack hook: a host copy of all but the parameters
            kept = [s if is_parameter(s) else self.offloading.setdefault(s.uid, Offloaded(s))
                    for s in cast("list[Sym]", kept)]   # only Syms so far
        node = Node(output, edges, kept, self.segment, scratch, passthrough, self.region, carries or [], drops or [])
        self.tape.append(node)
        if self.rerun_left is not None and node.saved:
            self.rerun_left -= 1
            if self.rerun_left == 0:
                raise RecomputeDone

    def op_output(self, numel: int, dtype: str, kind: str) -> Sym:
        """The output of a matmul or attention kernel (`kind`: mm, addmm, bmm, attention, or quantized for a
        quantized linear's kernel): what selective checkpointing may keep."""
        region = self.region
        if region is not None and region.keeps(kind):
            if region.reuse is not None:
                return region.reuse.pop(0)
            out = self.new(numel, dtype)
            region.kept.append(out)
            return out
        return self.new(numel, dtype)

    # ---- blocks: gathered, streamed, checkpointed (recompute.py) ------------------------------
    def block_numel(self, segment) -> int:
        """The parameters of block `segment` (stack, layer), counted once every parameter is declared (at the
        first block the program runs)."""
        if self._block_numels is None:
            self._block_numels = block_numels(self.params)
        stack, layer = segment
        return self._block_numels.get((stack if isinstance(stack, str) else None, layer), 0)

    def block(self, index: int, fn: Callable[[Sym], T], x: Sym) -> T:
        """Run block `index` as `fn(x)`, checkpointed when the policy says so."""
        if self.gathers:   # all-gathered before the block runs, freed after (reshard_after_forward)
            self.gathers.gather(self.segment)
        if self.policy.stream_blocks:   # copied in from the host before the block runs, dropped after
            streamed = self.new(self.block_numel(self.segment), self.policy.param_dtype, category="parameters")
        every = self.policy.checkpoint_every
        try:
            if not (every and index % every == 0):
                return fn(x)
            if self.policy.checkpoint_offload:
                return recompute.offloaded(self, fn, x)
            return recompute.checkpointed(self, fn, x, selective=self.policy.checkpoint_selective)
        finally:
            if self.gathers:
                self.gathers.gather(None)
            if self.policy.stream_blocks:
                del streamed

    # ---- backward --------------------------------------------------------------------------
    def backward(self, loss: Sym, seed: Sym | None = None) -> None:
        """Run the tape in reverse: each node turns its output's gradient into its inputs' gradients,
        accumulates parameter gradients, and frees what it saved. `seed`: the output's gradient when it
        is not a scalar loss (a pipeline stage's, received from the next rank)."""
        self.segment = "post"                  # backward starts at the loss, after the layers
        pending: dict[int, Sym] = {loss.uid: seed if seed is not None else self.new(1, loss.dtype)}
        del seed
        tape, self.tape = self.tape, []
        self._param_uses: dict[int, int] = {}
        for node in tape:
            for edge in node.inputs:
                if edge[3] is not None:
                    self._param_uses[edge[0]] = self._param_uses.get(edge[0], 0) + 1
        self._param_buffer: dict[int, Sym] = {}
        if self.gathers:   # the last block is prefetched as backward starts
            self.gathers.gather(next((n.segment for n in reversed(tape) if isinstance(n.segment, tuple)), None))
        while tape:
            node = tape.pop()
            self.segment = node.segment
            if self.gathers and (isinstance(node.segment, tuple) or node.segment == "pre"):
                self.gathers.gather(node.segment)
            grad_out = pending.pop(node.output, None)
            if node.region is not None and not node.region.done and node.saved and grad_out is not None:
                first = len(tape)
                while first and tape[first - 1].region is node.region:
                    first -= 1
                recompute.recompute(self, node.region, tape[first:] + [node])
            if grad_out is not None:
                # offloaded saved tensors come back as device copies for this node only (the unpack hook)
                scratch = [self.new(s.numel, s.dtype) for s in node.saved if isinstance(s, Offloaded)]
                scratch += [self.new(n, dt) for n, dt in node.scratch]
                self.carried.update((key, self.new(n, dt)) for key, n, dt in node.carries)
                produced = [(edge, self._input_grad(node, edge, grad_out)) for edge in node.inputs]
                del scratch, grad_out
                for edge, grad in produced:
                    self._accumulate(edge, grad, pending)
                del produced
                for key in node.drops:
                    self.carried.pop(key, None)
            node.saved.clear()
            del node
        self.segment = "post"
        if self.gathers:
            self.gathers.end_backward()

    def _input_grad(self, node: Node, edge, grad_out: Sym) -> Sym:
        _, numel, dtype, _ = edge
        if node.passthrough and numel <= grad_out.numel and dtype == grad_out.dtype:
            return Alias(grad_out, numel, dtype)
        return self.new(numel, dtype)

    def _accumulate(self, edge, grad: Sym, pending: dict[int, Sym]) -> None:
        uid, _, _, param = edge
        if param is not None:
            # A parameter used several times (tied embeddings) collects its gradients in autograd's
            # input buffer, summed out of place, until the last use; then AccumulateGrad takes it.
            self._param_uses[uid] -= 1
            final = self._param_uses[uid] == 0
            earlier = self._param_buffer.pop(uid, None)
            first = param.grad_sym is None    # later micro-batches add into .grad in place
            if earlier is not None or grad.dtype != param.dtype:
                grad = self.new(param.numel, param.dtype, category="gradients" if final and first else None)
                del earlier
            if not final:
                self._param_buffer[uid] = grad
                return
            if self.gathers:   # an unsharded gradient, until its block is reduce-scattered
                self.gathers.unsharded_grads.append((param, grad))
                return
            if first and grad.category != "gradients":   # AccumulateGrad steals the tensor as .grad
                self.recategorize(grad, "gradients")
            if first and not self.policy.grads_leave:
                param.grad_sym = grad
            if self.policy.grad_bucket and self._bucket is None:
                self._bucket = self.new(self.policy.grad_bucket, self.policy.param_dtype, category="gradients")
            if self.gradient_ready is not None:
                self.gradient_ready(param)
            return
        if uid not in pending:
            pending[uid] = grad           # a second gradient for the same tensor is added in place

    # ---- results ---------------------------------------------------------------------------
    def peak_table(self) -> dict[tuple[str, object], tuple[PeakPoint, dict[str, int]]]:
        return {key: (point, self.category_max[key]) for key, point in self.peaks.items()}
