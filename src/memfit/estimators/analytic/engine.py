"""A symbolic autograd: tensors are (numel, dtype), ops follow PyTorch's save rules, and CPython's
reference counting frees them when the program lets go, as PyTorch's does.

The analytic estimator writes each model family as a short program over these symbols, mirroring
the Hugging Face forward code. Running it gives every allocation in closed form: what autograd saves
(activations), what backward allocates (temporaries, gradients), and when each is freed. Nothing is
a tensor; a 405B model costs the same microseconds as a tiny one.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from memfit.core.categories import CATEGORIES, zero_categories

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "uint8": 1, "int8": 1}


@dataclass(frozen=True)
class Policy:
    """How the run executes: which dtypes, which device's kernels and autocast lists."""

    param_dtype: str            # "float32" | "bfloat16"
    autocast_dtype: str | None  # "bfloat16" | "float16" | None
    backend: str                # "cpu" | "cuda"
    train: bool
    round_to: int = 1           # allocator granularity (CUDA caching allocator: 512 bytes)
    checkpoint_every: int = 0   # activation checkpointing of blocks 0, n, 2n, ... (0: none)
    checkpoint_selective: bool = False   # keep matmul/attention outputs, recompute the rest
    loss_chunks: int = 0        # chunked cross-entropy: LM head + loss over this many sequence slices
    fsdp: bool = False          # FSDP2: each block's parameters all-gathered while it runs (see _gather)
    fsdp_reshard: bool = True   # FSDP2 frees a block's gathered parameters after its forward (else after backward)
    grads_leave: bool = False   # each gradient is freed once accumulated: copied to the host (cpu-offload) or
    #                             into DDP's buckets (ddp:bucket_view=true)
    checkpoint_offload: bool = False   # checkpointing:mode=offload: the blocks' saved tensors go to the host
    stream_blocks: bool = False  # stream-layers: block weights live on the host, copied in while a block runs
    grad_bucket: int = 0        # DeepSpeed ZeRO-1/2: a reduction bucket of this many elements, allocated when
    #                             the first gradient arrives and kept


_serial = itertools.count()


class Sym:
    __slots__ = ("eng", "numel", "dtype", "grad", "category", "counted", "uid", "__weakref__")

    def __init__(self, eng: Engine, numel: int, dtype: str, grad: bool, category: str, counted: bool = True):
        self.eng, self.numel, self.dtype, self.grad, self.category, self.counted = eng, int(numel), dtype, grad, category, counted
        self.uid = next(_serial)
        if counted:
            eng._account(self, +1)

    @property
    def nbytes(self) -> int:
        size = self.numel * DTYPE_BYTES[self.dtype]
        step = self.eng.policy.round_to
        return -(-size // step) * step if step > 1 else size

    def __del__(self):
        if self.counted:
            try:
                self.eng._account(self, -1)
            except Exception:  # interpreter shutdown
                pass


class Param(Sym):
    """A parameter: lives for the whole run, its gradient is accumulated into `.grad`."""

    __slots__ = ("name", "grad_sym", "shape", "lora", "frozen", "quant")

    def __init__(self, eng: Engine, name: str, numel: int, dtype: str, trainable: bool = True):
        super().__init__(eng, numel, dtype, trainable, "parameters")
        self.name = name
        self.grad_sym: Sym | None = None
        self.lora: tuple[Param, Param] | None = None   # LoRA's (A, B) on this weight (techniques/adapters.py)
        self.frozen = False   # requires_grad=False (LoRA's base weights): autocast does not cache its casts
        # how its linears run (analytic/weights.py): (the technique's name or "4bit", the weight's dtype before,
        # the quantization state's parameters, double quantization)
        self.quant: tuple[str, str, list[Param], bool] | None = None


class View(Sym):
    """A view of another tensor: allocates nothing, keeps its base alive; its gradient flows back into a
    gradient the size of the base (as slice/expand backward allocate)."""

    __slots__ = ("base",)

    def __init__(self, base: Sym, numel: int) -> None:
        super().__init__(base.eng, numel, base.dtype, base.grad, base.category, counted=False)
        self.base = base
        base.eng.record(self, [base], [])


class Alias(Sym):
    """A gradient that is another gradient (add's and clone's backward pass it on unchanged; cat's
    hands out slices): no allocation, keeps the original alive."""

    __slots__ = ("base",)

    def __init__(self, base: Sym, numel: int, dtype: str) -> None:
        super().__init__(base.eng, numel, dtype, False, base.category, counted=False)
        self.base = base


class Offloaded:
    """A saved tensor copied to host RAM (activation offload): counted in the engine's host bytes while
    a node still holds it; backward brings a device copy back for the node that uses it."""

    __slots__ = ("eng", "numel", "dtype", "nbytes")

    def __init__(self, sym: Sym) -> None:
        self.eng, self.numel, self.dtype = sym.eng, sym.numel, sym.dtype
        self.nbytes = sym.numel * DTYPE_BYTES[sym.dtype]
        self.eng._host(+self.nbytes)

    def __del__(self):
        try:
            self.eng._host(-self.nbytes)
        except Exception:  # interpreter shutdown
            pass


def _is_parameter(sym: Sym) -> bool:
    while isinstance(sym, View):
        sym = sym.base
    return isinstance(sym, Param)


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


def _block_of(name: str) -> tuple[int, str | None] | None:
    """(layer, stack name or None) of a parameter named `<stack>.<layer>.<rest>`; None outside the blocks."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return int(parts[1]), parts[0] if parts[0] in ("encoder", "decoder") else None
    return None


class _RecomputeDone(Exception):
    """Non-reentrant checkpoint stops re-running a block once every saved tensor is back."""


class Region:
    """A checkpointed block (torch.utils.checkpoint, non-reentrant). In the forward its nodes keep
    nothing: the block's inputs stay alive through `fn`, as checkpoint holds its arguments. The
    first backward node that needs a saved tensor re-runs `fn`; the re-run's saved tensors go to the
    original nodes, in recording order, and the re-run stops after the last of them. Selective
    (SAC): the outputs of matmuls and attention are kept from the forward and reused, not recomputed."""

    def __init__(self, fn, x: Sym, selective: bool) -> None:
        self.fn, self.x, self.selective = fn, x, selective
        self.kept: list[Sym] = []         # selective: op outputs stored in the forward, in order
        self.reuse: list[Sym] | None = None   # during the re-run: kept outputs still to hand out
        self.done = False


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
        self.log: list | None = None  # set to [] to record (phase, segment, category, +/-bytes, dtype, numel)
        self.inputs_are_views = False
        self.region: Region | None = None         # the checkpointed block being run, if any
        self._gathered: tuple[object, Sym] | None = None   # FSDP2: (segment, its unsharded parameters)
        self._root_gathered: Sym | None = None
        self._kept_gathered: dict[object, Sym] = {}        # FSDP2 without resharding: gathered until backward
        self._unsharded_grads: list[tuple[Param, Sym]] = []
        self._rerun_left: int | None = None       # saving nodes still to record in a re-run
        self._offloading: dict[int, Offloaded] | None = None   # in an offloaded block: its host copies by uid
        self.host_live = 0
        self.host_peak = 0
        self._bucket: Sym | None = None

    # ---- accounting ------------------------------------------------------------------------
    def _account(self, sym: Sym, sign: int) -> None:
        nbytes = sym.nbytes * self.weights[sym.category]
        self.live[sym.category] += sign * nbytes
        self.total += sign * nbytes
        if self.log is not None:
            self.log.append((self.phase, self.segment, sym.category, sign * nbytes, sym.dtype, sym.numel))
        if sign > 0:
            self._observe(sym.category)

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
        self.phase, self.segment = phase, segment
        if self.policy.fsdp and phase == "forward" and self._root_gathered is None:
            # the root module (parameters outside the blocks) is unsharded for forward and backward
            self._root_gathered = self.new(self._root_numel(), self.policy.param_dtype)
        self._observe()

    # ---- FSDP2 all-gathers -----------------------------------------------------------------
    def _block_numel(self, segment) -> int:
        stack, layer = segment
        return sum(p.numel for name, p in self.params.items()
                   if _block_of(name) == (layer, stack if isinstance(stack, str) else None))

    def _reduce_scatter(self) -> None:
        """FSDP2's post-backward: the unsharded gradients are copied into one flat buffer, reduce-scattered
        into this rank's shard (kept as .grad), and the unsharded ones freed."""
        if not self._unsharded_grads:
            return
        flat = self.new(sum(p.numel for p, _ in self._unsharded_grads), self._unsharded_grads[0][1].dtype)
        for param, _ in self._unsharded_grads:
            if param.grad_sym is None:
                param.grad_sym = self.new(param.numel, param.dtype, category="gradients")
        self._unsharded_grads = []
        del flat

    def _root_numel(self) -> int:
        return sum(p.numel for name, p in self.params.items() if _block_of(name) is None)

    def _gather(self, segment) -> None:
        """Hold `segment`'s unsharded parameters (none for a segment outside the blocks), freeing the last.
        In backward, leaving a block reduce-scatters the gradients it produced."""
        if self._gathered is not None and self._gathered[0] == segment:
            return
        if self._gathered is not None and self.phase == "backward":
            self._reduce_scatter()
            self._kept_gathered.pop(self._gathered[0], None)   # resharded once its backward is done
        self._gathered = None
        if isinstance(segment, tuple):
            gathered = self._kept_gathered.get(segment)
            if gathered is None:
                gathered = self.new(self._block_numel(segment), self.policy.param_dtype)
                if not self.policy.fsdp_reshard:
                    self._kept_gathered[segment] = gathered
            self._gathered = (segment, gathered)

    def stream_from_host(self) -> None:
        """stream-layers: the blocks' declared weights move to host RAM (counted there, not on the device)."""
        for name, param in self.params.items():
            if _block_of(name) is not None and param.counted:
                self._account(param, -1)
                param.counted = False
                self._host(param.nbytes)

    # ---- creating symbols ------------------------------------------------------------------
    def param(self, name: str, shape: tuple[int, ...], trainable: bool = True) -> Param:
        if name not in self.params:
            numel = 1
            for size in shape:
                numel *= size
            param = Param(self, name, numel, self.policy.param_dtype, trainable and self.policy.train)
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
            kept = [s for s in saved if isinstance(s, Sym)]
            if self._offloading is not None:   # the pack hook: a host copy of all but the parameters
                kept = [s if _is_parameter(s) else self._offloading.setdefault(s.uid, Offloaded(s)) for s in kept]
            node = Node(output.uid, edges, kept, self.segment, scratch or [], passthrough, self.region)
            self.tape.append(node)
            if self._rerun_left is not None and node.saved:
                self._rerun_left -= 1
                if self._rerun_left == 0:
                    raise _RecomputeDone
        return output

    def op_output(self, numel: int, dtype: str) -> Sym:
        """The output of a matmul or attention kernel: what selective checkpointing keeps."""
        region = self.region
        if region is not None and region.selective:
            if region.reuse is not None:
                return region.reuse.pop(0)
            out = self.new(numel, dtype)
            region.kept.append(out)
            return out
        return self.new(numel, dtype)

    # ---- checkpointing ---------------------------------------------------------------------
    def block(self, index: int, fn, x: Sym) -> Sym:
        """Run block `index` as `fn(x)`, checkpointed when the policy says so."""
        if self.policy.fsdp:   # all-gathered before the block runs, freed after (reshard_after_forward)
            self._gather(self.segment)
        if self.policy.stream_blocks:   # copied in from the host before the block runs, dropped after
            streamed = self.new(self._block_numel(self.segment), self.policy.param_dtype, category="parameters")
        every = self.policy.checkpoint_every
        try:
            if not (every and index % every == 0):
                return fn(x)
            if self.policy.checkpoint_offload:
                return self.offloaded(fn, x)
            return self.checkpointed(fn, x, selective=self.policy.checkpoint_selective)
        finally:
            if self.policy.fsdp:
                self._gather(None)
            if self.policy.stream_blocks:
                del streamed

    def offloaded(self, fn, x: Sym) -> Sym:
        """`fn(x)` with its saved tensors copied to the host as they are saved (one copy per tensor)."""
        if not self.policy.train:
            return fn(x)
        self._offloading = {}
        try:
            return fn(x)
        finally:
            self._offloading = None

    def checkpointed(self, fn, x: Sym, *, selective: bool = False):
        """`fn(x)` under torch.utils.checkpoint (non-reentrant: it applies when only the block's parameters
        need gradients too, as under LoRA, whose first block's input needs none)."""
        if not self.policy.train:
            return fn(x)
        region = Region(fn, x, selective)
        start = len(self.tape)
        self.region = region
        try:
            out = fn(x)
        finally:
            self.region = None
        for node in self.tape[start:]:
            node.saved = [True] * len(node.saved)   # placeholders: what the re-run must bring back
        return out

    def _recompute(self, region: Region, nodes: list[Node]) -> None:
        """Re-run `region`; `nodes` are its nodes still on the tape, in recording order."""
        saving = [node for node in nodes if node.saved]
        outer_tape, self.tape = self.tape, []
        self.region, region.reuse = region, list(region.kept)
        region.kept = []
        self._rerun_left = len(saving)
        autocast = self.autocast_on
        self.autocast_on = self.policy.autocast_dtype is not None   # checkpoint re-enters the autocast state
        try:
            region.fn(region.x)
        except _RecomputeDone:
            pass
        finally:
            self._rerun_left, self.region, self.autocast_on = None, None, autocast
            self.cast_cache.clear()
        rerun = [node for node in self.tape if node.saved]
        self.tape = outer_tape
        assert len(rerun) == len(saving), (len(rerun), len(saving))
        for node, again in zip(saving, rerun):
            node.saved = again.saved
        region.reuse, region.done = None, True

    # ---- backward --------------------------------------------------------------------------
    def backward(self, loss: Sym, seed: Sym | None = None) -> None:
        """Run the tape in reverse: each node turns its output's gradient into its inputs' gradients,
        accumulates parameter gradients, and frees what it saved. `seed`: the output's gradient when it
        is not a scalar loss (a pipeline stage's, received from the next rank)."""
        self.segment = "post"                  # backward starts at the loss, after the layers
        pending: dict[int, Sym] = {loss.uid: seed if seed is not None else self.new(1, loss.dtype)}
        del seed
        tape, self.tape = self.tape, []
        self._param_uses = {}
        for node in tape:
            for edge in node.inputs:
                if edge[3] is not None:
                    self._param_uses[edge[0]] = self._param_uses.get(edge[0], 0) + 1
        self._param_buffer: dict[int, Sym] = {}
        if self.policy.fsdp:   # the last block is prefetched as backward starts
            self._gather(next((n.segment for n in reversed(tape) if isinstance(n.segment, tuple)), None))
        while tape:
            node = tape.pop()
            self.segment = node.segment
            if self.policy.fsdp and (isinstance(node.segment, tuple) or node.segment == "pre"):
                self._gather(node.segment)
            grad_out = pending.pop(node.output, None)
            if node.region is not None and not node.region.done and node.saved and grad_out is not None:
                first = len(tape)
                while first and tape[first - 1].region is node.region:
                    first -= 1
                self._recompute(node.region, tape[first:] + [node])
            if grad_out is not None:
                # offloaded saved tensors come back as device copies for this node only (the unpack hook)
                scratch = [self.new(s.numel, s.dtype) for s in node.saved if isinstance(s, Offloaded)]
                scratch += [self.new(n, dt) for n, dt in node.scratch]
                produced = [(edge, self._input_grad(node, edge, grad_out)) for edge in node.inputs]
                del scratch, grad_out
                for edge, grad in produced:
                    self._accumulate(edge, grad, pending)
                del produced
            node.saved.clear()
            del node
        self.segment = "post"
        if self.policy.fsdp:
            self._gather(None)
            self._reduce_scatter()          # the root's own gradients
            self._root_gathered = None

    def _input_grad(self, node: Node, edge, grad_out: Sym) -> Sym:
        _, numel, dtype, _ = edge
        if node.passthrough and numel <= grad_out.numel and dtype == grad_out.dtype:
            return Alias(grad_out, numel, dtype)
        return self.new(numel, dtype)

    def _accumulate(self, edge, grad: Sym, pending: dict[int, Sym]) -> None:
        uid, numel, dtype, param = edge
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
            if self.policy.fsdp:   # an unsharded gradient, until its block is reduce-scattered
                self._unsharded_grads.append((param, grad))
                return
            if first and grad.category != "gradients":   # AccumulateGrad steals the tensor as .grad
                self._account(grad, -1)
                grad.category = "gradients"
                self._account(grad, +1)
            if first and not self.policy.grads_leave:
                param.grad_sym = grad
            if self.policy.grad_bucket and self._bucket is None:
                self._bucket = self.new(self.policy.grad_bucket, self.policy.param_dtype, category="gradients")
            return
        if uid not in pending:
            pending[uid] = grad           # a second gradient for the same tensor is added in place

    # ---- results ---------------------------------------------------------------------------
    def peak_table(self) -> dict[tuple[str, object], tuple[PeakPoint, dict[str, int]]]:
        return {key: (point, self.category_max[key]) for key, point in self.peaks.items()}
