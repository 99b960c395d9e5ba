"""Reading an out-of-memory after the fact: PyTorch's OOM message and its memory snapshot files.

The message (c10/cuda/CUDACachingAllocator.cpp; the same for XPU), in PyTorch 2.x:
  "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which
   1.25 GiB is free. Process 1234 has 77.89 GiB memory in use. Including non-PyTorch memory, this process
   has 77.88 GiB memory in use. Of the allocated memory 74.02 GiB is allocated by PyTorch, and 3.21 GiB
   is reserved by PyTorch but unallocated. ..."
and in 1.x: "... Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB already
allocated; 3.12 MiB free; 14.61 GiB reserved in total by PyTorch) ...".

A snapshot (`torch.cuda.memory._dump_snapshot`, or torch.cuda._memory_viz's conversion of a profile) is a
pickled dict: "segments" (cudaMalloc'd segments, each a list of blocks: active or inactive, with the
stack that allocated them when history was recorded) and "device_traces" (the allocator's actions:
alloc, free_requested, free_completed, segment_alloc, segment_free, oom, snapshot). It is loaded with an
unpickler that refuses every class and function: only plain dicts, lists, strings and numbers load, so
a file can never run code.
"""
from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass, field
from typing import cast

from memfit.core.errors import MemfitError

_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB)\b"
_UNIT = {"bytes": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNIT[unit])


@dataclass
class OomMessage:
    """The figures of one OOM message, in bytes (None where that PyTorch version does not print them)."""

    device: str                        # "GPU 0"
    tried_bytes: int
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None          # by PyTorch's tensors
    reserved_unallocated_bytes: int | None = None   # cached by the allocator, no tensor in it
    process_bytes: int | None = None            # this process, non-PyTorch memory included
    other_processes: dict[str, int] = field(default_factory=dict)   # "Process 1234" -> bytes

    @property
    def reserved_bytes(self) -> int | None:
        if self.allocated_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_bytes + self.reserved_unallocated_bytes

    @property
    def non_pytorch_bytes(self) -> int | None:
        """This process's memory outside the allocator: CUDA context, cuBLAS/cuDNN workspaces, NCCL."""
        if self.process_bytes is None or self.reserved_bytes is None:
            return None
        return max(0, self.process_bytes - self.reserved_bytes)

    @property
    def shortfall_bytes(self) -> int:
        """How much more the failed allocation needed than the device had free."""
        return max(0, self.tried_bytes - (self.free_bytes or 0))


def parse_oom_message(text: str) -> OomMessage:
    """The figures of the last OOM message in `text` (a log, a traceback or the message itself)."""
    starts = [m.start() for m in re.finditer(r"out of memory\.\s+Tried\s+to\s+allocate", text)]
    if not starts:
        raise MemfitError("no PyTorch out-of-memory message found (looked for \"out of memory. Tried to "
                          "allocate ...\"); pass the log or traceback that holds it, or a memory snapshot .pickle.")
    body = " ".join(text[starts[-1]:].split())   # a log may wrap the message over lines
    tried = re.search(r"Tried to allocate " + _SIZE, body)
    if tried is None:
        raise MemfitError(f"the out-of-memory message is cut off or garbled after \"Tried to allocate\" "
                          f"({body[:80]!r}); pass the whole message, as PyTorch printed it.")
    message = OomMessage(device="GPU 0", tried_bytes=_bytes(*tried.groups()))
    modern = re.search(r"(GPU|Device) (\d+) has a total capac\w* of " + _SIZE + r" of which " + _SIZE + r" is free",
                       body)
    if modern:
        message.device = f"GPU {modern.group(2)}"
        message.total_bytes = _bytes(modern.group(3), modern.group(4))
        message.free_bytes = _bytes(modern.group(5), modern.group(6))
        for pid, number, unit in re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", body):
            message.other_processes[f"process {pid}"] = _bytes(number, unit)
        if own := re.search(r"this process has " + _SIZE + r" memory in use", body):
            message.process_bytes = _bytes(*own.groups())
        if allocated := re.search(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch", body):
            message.allocated_bytes = _bytes(*allocated.groups())
        if cached := re.search(r"and " + _SIZE + r" is reserved by PyTorch but unallocated", body):
            message.reserved_unallocated_bytes = _bytes(*cached.groups())
        return message
    legacy = re.search(r"\(GPU (\d+); " + _SIZE + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE
                       + r" free; " + _SIZE + r" reserved in total by PyTorch\)", body)
    if legacy:
        message.device = f"GPU {legacy.group(1)}"
        message.total_bytes = _bytes(legacy.group(2), legacy.group(3))
        message.allocated_bytes = _bytes(legacy.group(4), legacy.group(5))
        message.free_bytes = _bytes(legacy.group(6), legacy.group(7))
        message.reserved_unallocated_bytes = _bytes(legacy.group(8), legacy.group(9)) - message.allocated_bytes
    return message


# ---- snapshots ------------------------------------------------------------------------------------

class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise MemfitError(f"the snapshot asks to load {module}.{name}; a PyTorch memory snapshot holds only plain "
                          "data, so memfit refuses it (loading it could run code).")


def load_snapshot(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise MemfitError(f"no such snapshot file {path!r}.") from None
    try:
        data = _PlainDataUnpickler(io.BytesIO(raw)).load()
    except _MALFORMED_PICKLE as exc:
        raise MemfitError(f"{path!r} is not a PyTorch memory snapshot pickle ({type(exc).__name__}: "
                          f"{str(exc)[:80]}).") from None
    if not isinstance(data, dict) or "segments" not in data:
        raise MemfitError(f"{path!r} is a pickle but not a memory snapshot (no \"segments\"); write one with "
                          "torch.cuda.memory._dump_snapshot().")
    problem = _snapshot_problem(data)
    if problem:
        raise MemfitError(f"{path!r} is not a memory snapshot memfit can read: {problem}.")
    return data


# What the unpickler raises on bytes that are not a well-formed pickle (the pickle module documents an open
# list: "including but not necessarily limited to" these)
_MALFORMED_PICKLE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
                     AttributeError, OverflowError, MemoryError, RecursionError)


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _frames_problem(entry: dict, where: str) -> str | None:
    frames = entry.get("frames", [])
    if not isinstance(frames, list) or not all(isinstance(f, dict) for f in frames):
        return f"{where} has frames that are not a list of stack frames"
    if any(not isinstance(f.get(key, ""), str) for f in frames for key in ("filename", "name")):
        return f"{where} has a stack frame whose file or function name is not text"
    return None


def _snapshot_problem(data: dict) -> str | None:
    """What in `data` does not have the snapshot format's shape (torch.cuda.memory._snapshot), or None: the
    summary below may then read every field it uses without checking it again."""
    segments = data["segments"]
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        return '"segments" is not a list of segments'
    for i, segment in enumerate(segments):
        blocks = segment.get("blocks", [])
        if not _is_size(segment.get("total_size", 0)) or not isinstance(segment.get("device", 0), int):
            return f"segment {i} has no valid total_size or device"
        if not isinstance(blocks, list) or not all(isinstance(b, dict) and _is_size(b.get("size")) for b in blocks):
            return f"segment {i}'s blocks are not a list of blocks with a size in bytes"
        for block in blocks:
            if not isinstance(block.get("state", ""), str):
                return f"a block of segment {i} has a state that is not text"
            if problem := _frames_problem(block, f"a block of segment {i}"):
                return problem
    traces = data.get("device_traces") or []
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        return '"device_traces" is not a list of traces (one per device)'
    for trace in traces:
        for entry in trace:
            if not isinstance(entry, dict) or not isinstance(entry.get("action"), str):
                return "a trace entry has no action"
            action = entry["action"]
            if action == "alloc" and not (_is_size(entry.get("size")) and isinstance(entry.get("addr"), int)):
                return "an alloc entry has no address or size in bytes"
            if action.startswith("free") and not isinstance(entry.get("addr", 0), int):
                return "a free entry's address is not a number"
            if action == "oom" and not all(_is_size(entry.get(k, 0)) for k in ("size", "device_free")):
                return "the oom entry's size or free bytes are not numbers"
            if not isinstance(entry.get("category", ""), (str, type(None))):
                return "a trace entry's category is not text"
            if problem := _frames_problem(entry, f"a {action} entry"):
                return problem
    return None


# Where a stack frame says the memory came from, first match wins (a heuristic: labelled so).
_FRAME_RULES = (
    ("kv_cache", ("cache_utils", "past_key_value", "DynamicCache", "StaticCache", "kv_cache")),
    ("optimizer_states", ("optim/", "optimizer.py", "_init_group", "adamw", "adam.py", "bitsandbytes/optim")),
    ("gradients", ("accumulate_grad", "AccumulateGrad")),
    ("activations", ("forward", "nn.Module:")),
    ("parameters", ("_apply", "load_state_dict", "from_pretrained", "module.py(") + ("to(",)),
    ("backward temporaries", ("backward", "autograd")),
)
_PROFILER_CATEGORIES = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer_states",
                        "activation": "activations", "temporary": "temporaries", "input": "inputs",
                        "autograd_detail": "backward temporaries"}


def category_of(entry: dict) -> str:
    """The category of an allocation: the profiler's own label where the snapshot came from a profile, else
    the first stack frame rule that matches (frames innermost first), else "unknown (no stack recorded)"."""
    if entry.get("category") in _PROFILER_CATEGORIES:
        return _PROFILER_CATEGORIES[entry["category"]]
    frames = entry.get("frames") or []
    if not frames:
        return "unknown (no stack recorded)"
    texts = [f"{f.get('filename', '')} {f.get('name', '')}" for f in frames]
    for category, needles in _FRAME_RULES:
        if any(needle in text for text in texts for needle in needles):
            return category
    return "other"


@dataclass
class SnapshotSummary:
    reserved_bytes: int                      # all segments
    allocated_bytes: int                     # active blocks
    largest_free_block_bytes: int            # the largest inactive block: what can be served without cudaMalloc
    by_category: dict[str, int]              # live bytes at the moment shown, by category
    moment: str                              # "the OOM" | "the peak of the trace" | "the snapshot"
    oom_tried_bytes: int | None = None
    oom_device_free_bytes: int | None = None
    categories_source: str = "stack frames (heuristic)"

    @property
    def fragmentation_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes


def summarize_snapshot(snapshot: dict, device: int | None = None) -> SnapshotSummary:
    segments = [s for s in snapshot.get("segments", []) if device is None or s.get("device", 0) == device]
    blocks = [b for s in segments for b in s.get("blocks", [])]
    active = [b for b in blocks if str(b.get("state", "")).startswith("active")]
    inactive = [b for b in blocks if b.get("state") == "inactive"]
    traces = snapshot.get("device_traces") or []
    # traces[device]: device is not None there (a None device with traces takes the longest)
    trace = max(traces, key=len) if device is None and traces else (traces[cast(int, device)] if traces else [])
    summary = SnapshotSummary(
        reserved_bytes=sum(s.get("total_size", 0) for s in segments), allocated_bytes=sum(b["size"] for b in active),
        largest_free_block_bytes=max((b["size"] for b in inactive), default=0), by_category={}, moment="the snapshot")
    if any(e.get("category") for e in trace):
        summary.categories_source = "the PyTorch profiler's categories"
    replayed = _replay(trace)
    if replayed:
        summary.by_category, summary.moment, oom = replayed
        if oom:
            summary.oom_tried_bytes, summary.oom_device_free_bytes = oom.get("size"), oom.get("device_free")
    else:
        for block in active:
            category = category_of(block)
            summary.by_category[category] = summary.by_category.get(category, 0) + block["size"]
    return summary


def _replay(trace: list[dict]) -> tuple[dict[str, int], str, dict | None] | None:
    """Live allocations by category at the trace's OOM (or its peak): replays alloc and free actions."""
    # CUDA logs free_requested, then free_completed once the streams are done with the block
    freed_by = "free_completed" if any(e.get("action") == "free_completed" for e in trace) else "free_requested"
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: dict[int, dict] = {}
    for entry in trace:
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = entry
            total += entry["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == freed_by and entry.get("addr") in live:
            total -= live.pop(entry["addr"])["size"]
        elif action == "oom":
            return _by_category(live.values()), "the OOM", entry
    if not at_peak:
        return None
    return _by_category(at_peak.values()), "the peak of the trace", None


def _by_category(entries) -> dict[str, int]:
    out: dict[str, int] = {}
    for entry in entries:
        category = category_of(entry)
        out[category] = out.get(category, 0) + entry["size"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
