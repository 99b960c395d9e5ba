"""Which parameters belong to which block, and FSDP2's all-gathers of them in the symbolic engine.

A block is a segment `(stack, layer)` of the program; its parameters are named `<stack>.<layer>.<rest>`. With
FSDP2 (Policy.fsdp) each block's parameters are all-gathered while it runs and freed after (or kept until its
backward without resharding); the root's (embeddings, final norm, head) stay gathered through forward and
backward; leaving a block in backward copies its unsharded gradients into one flat buffer, reduce-scattered
into this rank's shard. Under FSDP2's MixedPrecisionPolicy (Policy.state_dtype) the gathered parameters and
their unsharded gradients are in the compute dtype, the flat buffer and the shards in the state dtype.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.estimators.analytic.symbols import Param, Sym

if TYPE_CHECKING:
    from memfit.estimators.analytic.engine import Engine


def block_of(name: str) -> tuple[int, str | None] | None:
    """(layer, stack name or None) of a parameter named `<stack>.<layer>.<rest>`; None outside the blocks."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return int(parts[1]), parts[0] if parts[0] in ("encoder", "decoder") else None
    return None


def block_numels(params: dict[str, Param]) -> dict[object, int]:
    """Each block's parameter count, by its segment `(stack, layer)` (stack None for a decoder's only one)."""
    numels: dict[object, int] = {}
    for name, p in params.items():
        block = block_of(name)
        if block is not None:
            layer, stack = block
            numels[stack, layer] = numels.get((stack, layer), 0) + p.numel
    return numels


def root_numel(params: dict[str, Param]) -> int:
    return sum(p.numel for name, p in params.items() if block_of(name) is None)


# FSDP2's side streams (torch.distributed.fsdp._fully_shard._fsdp_param_group: FSDPCommContext). The caching
# allocator keeps a pool per stream, so what is allocated there is never reused by the default stream's tensors.
ALL_GATHER_STREAM = "all-gather copy-in"
REDUCE_SCATTER_STREAM = "reduce-scatter"


class Gathers:
    """One engine's FSDP2 all-gathers and reduce-scatters, on the streams FSDP2 runs them on."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.gathered: tuple[object, Sym] | None = None    # (segment, its unsharded parameters)
        self.root: Sym | None = None
        self.kept: dict[object, Sym] = {}                  # without resharding: gathered until backward
        self.unsharded_grads: list[tuple[Param, Sym]] = []
        self.forward_buffer: Sym | None = None   # forward: the last all-gather's output, kept to overlap the next
        self.reduce_input: Sym | None = None     # the last reduce-scatter's input, kept until the next one starts

    def _unshard(self, numel: int) -> Sym:
        """A group's parameters all-gathered: a flat buffer on the copy-in stream, then copied out into the
        unsharded parameters on the default stream (wait_for_unshard). In forward the buffer lives until the next
        group's copy-out (AllGatherState); in backward it goes at once."""
        e = self.e
        with e.on_stream(ALL_GATHER_STREAM):
            buffer = e.new(numel, e.policy.param_dtype)
        self.forward_buffer = None
        unsharded = e.new(numel, e.policy.param_dtype)
        if e.phase == "forward":
            self.forward_buffer = buffer
        del buffer
        return unsharded

    def begin_forward(self) -> None:
        """The root module (parameters outside the blocks) is unsharded for forward and backward."""
        if self.root is None:
            self.root = self._unshard(root_numel(self.e.params))

    def end_forward(self) -> None:
        """The root's post-forward frees the last all-gather's output."""
        self.forward_buffer = None

    def reduce_scatter(self) -> None:
        """FSDP2's post-backward (foreach_reduce): the previous reduce-scatter's input is let go, the unsharded
        gradients are copied into one flat input (default stream) and freed, and the reduced shard (on the
        reduce-scatter stream) becomes every parameter's .grad; the input stays until the next post-backward."""
        e = self.e
        if not self.unsharded_grads:
            return
        self.reduce_input = None
        reduce_dtype = e.policy.state_dtype or self.unsharded_grads[0][1].dtype
        numel = sum(p.numel for p, _ in self.unsharded_grads)
        self.reduce_input = e.new(numel, reduce_dtype)
        params = [param for param, _ in self.unsharded_grads]
        self.unsharded_grads = []
        fresh = [param for param in params if param.grad_sym is None]
        if fresh:
            with e.on_stream(REDUCE_SCATTER_STREAM):
                shard = e.new(sum(p.numel for p in fresh), fresh[0].state_dtype, category="gradients")
            for param in fresh:
                param.grad_sym = shard

    def gather(self, segment) -> None:
        """Hold `segment`'s unsharded parameters (none for a segment outside the blocks), freeing the last.
        In backward, leaving a block reduce-scatters the gradients it produced."""
        e = self.e
        if self.gathered is not None and self.gathered[0] == segment:
            return
        if self.gathered is not None and e.phase == "backward":
            self.reduce_scatter()
            self.kept.pop(self.gathered[0], None)   # resharded once its backward is done
        self.gathered = None
        if isinstance(segment, tuple):
            gathered = self.kept.get(segment)
            if gathered is None:
                gathered = self._unshard(e.block_numel(segment))
                if not e.policy.fsdp_reshard:
                    self.kept[segment] = gathered
            self.gathered = (segment, gathered)

    def end_backward(self) -> None:
        self.gather(None)
        self.reduce_scatter()          # the root's own gradients
        self.root = None
        self.reduce_input = None       # the root's final callback waits for the last reduce-scatter
