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


def block_numel(params: dict[str, Param], segment) -> int:
    stack, layer = segment
    return sum(p.numel for name, p in params.items()
               if block_of(name) == (layer, stack if isinstance(stack, str) else None))


def root_numel(params: dict[str, Param]) -> int:
    return sum(p.numel for name, p in params.items() if block_of(name) is None)


class Gathers:
    """One engine's FSDP2 all-gathers."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.gathered: tuple[object, Sym] | None = None    # (segment, its unsharded parameters)
        self.root: Sym | None = None
        self.kept: dict[object, Sym] = {}                  # without resharding: gathered until backward
        self.unsharded_grads: list[tuple[Param, Sym]] = []

    def begin_forward(self) -> None:
        """The root module (parameters outside the blocks) is unsharded for forward and backward."""
        if self.root is None:
            self.root = self.e.new(root_numel(self.e.params), self.e.policy.param_dtype)

    def reduce_scatter(self) -> None:
        """FSDP2's post-backward: the unsharded gradients are copied into one flat buffer, reduce-scattered
        into this rank's shard (kept as .grad), and the unsharded ones freed."""
        e = self.e
        if not self.unsharded_grads:
            return
        reduce_dtype = e.policy.state_dtype or self.unsharded_grads[0][1].dtype
        flat = e.new(sum(p.numel for p, _ in self.unsharded_grads), reduce_dtype)
        for param, _ in self.unsharded_grads:
            if param.grad_sym is None:
                param.grad_sym = e.new(param.numel, param.state_dtype, category="gradients")
        self.unsharded_grads = []
        del flat

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
                gathered = e.new(block_numel(e.params, segment), e.policy.param_dtype)
                if not e.policy.fsdp_reshard:
                    self.kept[segment] = gathered
            self.gathered = (segment, gathered)

    def end_backward(self) -> None:
        self.gather(None)
        self.reduce_scatter()          # the root's own gradients
        self.root = None
