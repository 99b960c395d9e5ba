"""The program of a model without a written family: derived from its traced block (estimators/derived_program.py).

The recorded forward runs part by part — before the layers, each layer (as `Engine.block`, so checkpointing,
offload and FSDP2's gathers apply), after them — each storage born and freed where the trace had it, each backward
node added where forward created it. Layer i's reads of the first layer's input are of layer i-1's output; the
parameters of the block are named `layers.{i}.<name>`. Backward is the engine's, node by node.
"""
from __future__ import annotations

from memfit.core.errors import NotModelled
from memfit.estimators.analytic.engine import Engine
from memfit.estimators.analytic.symbols import Param, Sym, new_uid
from memfit.estimators.derived_program import DerivedProgram, numel

FAMILIES: tuple[str, ...] = ()   # derived for any traceable decoder (registry.program_of), not by model type


def declare_params(e: Engine, d: DerivedProgram, num_layers: int) -> None:
    """The model's parameters in its own order, the block's once per layer."""
    for p in d.parameters:
        for i in range(num_layers) if p.in_block else [None]:
            e.param(p.name.format(i=i), p.shape, trainable=p.trainable,
                    dtype=p.dtype if p.dtype != e.policy.param_dtype else None)


def declare_buffers(e: Engine, d: DerivedProgram) -> list[Sym]:
    """The model's buffers (rotary frequencies, masks it registered), alive all step."""
    return [e.new(numel(d.storages[sid].dims, 1, 1), d.storages[sid].dtype, category="buffers") for sid in d.buffers]


class _Replay:
    def __init__(self, e: Engine, d: DerivedProgram, num_layers: int, batch: int, seq: int) -> None:
        if e.policy.checkpoint_selective or e.policy.stream_blocks:   # (a chunked loss is in the recording)
            raise NotModelled("a derived program re-runs whole blocks: selective policies and streamed layers are "
                              "traced (--method traced).")
        self.e, self.d, self.layers, self.batch, self.seq = e, d, num_layers, batch, seq
        self.env: dict[tuple[object, int], Sym] = {}    # (layer or part, storage) -> its symbol
        self.keys: dict[tuple[object, int], int] = {}   # (layer or part, node) -> the uid its gradient arrives at
        self.loss_uid = -1
        self.shared: dict[int, Sym] = {}
        self.params = {sid: [e.params[p.name.format(i=i)] for i in range(num_layers)] if p.in_block
                       else e.params[p.name] for p in d.parameters for sid in [p.storage]}

    def numel(self, dims) -> int:
        return numel(dims, self.batch, self.seq)

    # ---- which symbol a recorded storage or node is, seen from layer `layer` -----------------------------------
    def owner(self, part: str, sid: int, layer: int) -> tuple[object, int]:
        d, last = self.d, self.layers - 1
        if part == "block":
            if sid == d.block_inputs[0]:   # the layer's input: what Engine.block passed (the previous output)
                return ("in", layer), sid
            if (layer, sid) in self.env:
                return layer, sid
            return ("shared", sid) if sid in self.shared else ("pre", sid)
        if part == "post":
            return next(((scope, sid) for scope in ("post", last) if (scope, sid) in self.env), ("pre", sid))
        return "pre", sid

    def storage(self, part: str, sid: int, layer: int) -> Sym:
        if sid in self.params:
            params = self.params[sid]
            return params[layer if part == "block" else 0] if isinstance(params, list) else params
        scope, _ = key = self.owner(part, sid, layer)
        return self.shared[sid] if scope == "shared" else self.env[key]

    def node_uid(self, part: str, index: int, layer: int) -> int:
        """The uid node `index` (an edge's target) has, seen from a node of `part` at `layer`."""
        d = self.d
        source = d.nodes[index].part
        if source == "block":
            return self.keys[(layer if part == "block" else self.layers - 1, index)]
        if source == "pre" and part == "block" and layer > 0:   # the previous layer's output
            return self.keys[(layer - 1, d.block_output_node)]
        return self.keys[(source, index)]

    # ---- running a part ---------------------------------------------------------------------------------------
    def run(self, part: str, layer: int) -> None:
        scope = layer if part == "block" else part
        e, d = self.e, self.d
        for kind, value in d.parts[part]:   # uids first: an in-place op on a view points earlier nodes at later ones
            if kind == "node":
                self.keys[(scope, value)] = self.loss_uid if value == d.root else new_uid()
        for kind, value in d.parts[part]:
            if kind == "birth":
                if value in self.params:
                    continue
                storage = d.storages[value]
                self.env[(scope, value)] = e.new(self.numel(storage.dims), storage.dtype)
            elif kind == "death":
                self.env.pop(self.owner(part, value, layer), None)
            else:
                self.add_node(part, value, layer)

    def add_node(self, part: str, index: int, layer: int) -> None:
        e, d = self.e, self.d
        node = d.nodes[index]
        scope = layer if part == "block" else part
        key = self.keys[(scope, index)]
        if not e.policy.train:
            return
        edges: list[tuple[int, int, str, Param | None]] = []
        for target, param_name, dims, dtype in node.edges:
            if param_name is not None:
                param = e.params.get(param_name.format(i=layer))
                if param is not None and param.grad:
                    edges.append((param.uid, param.numel, dtype, param))
            else:
                edges.append((self.node_uid(part, target, layer), self.numel(dims), dtype, None))
        saved = [self.storage(part, sid, layer) for sid in node.saved + node.held if self.known(part, sid, layer)]
        scratch = [(self.numel(d.storages[sid].dims), d.storages[sid].dtype) for sid in node.scratch]
        carries = [((scope, sid), self.numel(d.storages[sid].dims), d.storages[sid].dtype) for sid in node.carries]
        e.add_node(key, edges, saved, scratch, node.passthrough, carries, [(scope, sid) for sid in node.drops])

    def known(self, part: str, sid: int, layer: int) -> bool:
        key = self.owner(part, sid, layer)
        return sid in self.params or key in self.env or key[0] == "shared"


def train(e: Engine, d: DerivedProgram, num_layers: int, batch: int, seq: int, *, first: bool = True,
          last: bool = True, stage_outputs: list | None = None) -> Sym:
    if not (first and last):
        raise NotModelled("a derived program runs whole models, not pipeline stages; use --method traced.")
    replay = _Replay(e, d, num_layers, batch, seq)
    for sid in d.inputs:
        replay.env[("pre", sid)] = e.input(replay.numel(d.storages[sid].dims), d.storages[sid].dtype)
    loss = e.new(1, "float32", category="activations")
    replay.loss_uid = loss.uid
    e.segment = "pre"
    replay.run("pre", 0)
    # what the layers' nodes save of the part before them (rotary tables, masks) is held by the replay, which the
    # layers' closures hold: as a checkpoint holds its arguments until its re-run
    replay.shared = {sid: replay.env["pre", sid] for node in d.nodes if node.part == "block"
                     for sid in node.saved + node.held if sid != d.block_inputs[0] and ("pre", sid) in replay.env}
    x = replay.env[("pre", d.block_inputs[0])]
    for i in range(num_layers):
        e.segment = (0, i)

        def layer(x: Sym, i: int = i) -> Sym:
            replay.env[("in", i), d.block_inputs[0]] = x
            try:
                replay.run("block", i)
                return replay.env[(i, d.block_outputs[0])]
            finally:   # what the layer's nodes saved they hold; the rest its frame let go (a re-run stops early)
                for key in [k for k in replay.env if k[0] in (i, ("in", i)) and k[1] not in d.block_outputs]:
                    del replay.env[key]

        x = e.block(i, layer, x)
    e.segment = "post"
    replay.run("post", num_layers - 1)
    del x
    replay.env.clear()
    return loss


def inference(e: Engine, d: DerivedProgram, num_layers: int, batch: int, seq: int, new_tokens: int) -> None:
    raise NotModelled("a derived program models training; inference is traced (--method traced).")
