"""MemoryEstimate: the one result type of `estimate` and `measure`, and its stable JSON (memfit.estimate/1)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from memfit.core.categories import CATEGORIES, MODEL_STATE_CATEGORIES

SCHEMA = "memfit.estimate/1"


@dataclass
class ModuleMemory:
    name: str
    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0          # alive at the activations' own peak, allocated in this module's forward
    count: int = 1                # >1: one row stands for this many identical layers (per-layer figures)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activations


@dataclass
class MemoryEstimate:
    model: str
    num_parameters: int
    workload: dict
    method: str                                # analytic | traced | measured
    device: str                                # target GPU name, "cpu", or "cuda:0"
    peak_bytes: int
    peak_phase: str
    at_peak: dict[str, int]
    component_peaks: dict[str, int]
    model_state_bytes: dict[str, int]
    overhead_bytes: int = 0
    host_bytes: int = 0                        # host RAM that offloaded tensors need at their peak
    paged_bytes: int = 0                       # GPU target: CUDA unified memory (paged optimizer states), outside
    #                                            the allocator: on the device beside the rest, the excess paged out
    nvme_bytes: int = 0                        # NVMe offload: the states swapped to files on a local drive
    fits: bool | None = None
    headroom_bytes: int | None = None
    elapsed_s: float = 0.0
    device_memory_bytes: int | None = None
    sources: dict[str, str] = field(default_factory=dict)        # category / overhead part -> source
    overhead_detail: dict[str, int] = field(default_factory=dict)
    reserved_bytes: int | None = None          # GPU target: predicted max_memory_reserved (simulated allocator)
    allocator: dict[str, Any] | None = None    # GPU target: the simulated allocator's figures (caching_allocator.py)
    notes: list[str] = field(default_factory=list)
    modules: list[ModuleMemory] = field(default_factory=list)
    timeline: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)         # method-specific figures

    def __post_init__(self) -> None:
        assert set(self.at_peak) == set(CATEGORIES), self.at_peak
        assert sum(self.at_peak.values()) == self.peak_bytes, (self.at_peak, self.peak_bytes)

    @property
    def paged_out_bytes(self) -> int:
        """The paged states that do not fit on the device beside the rest: they live in host RAM."""
        return max(0, self.paged_bytes - max(0, self.headroom_bytes or 0))

    def apply_device(self, device_memory_bytes: int | None) -> None:
        """Decide fits/headroom for a device of this many bytes (None: no target)."""
        self.device_memory_bytes = device_memory_bytes
        if device_memory_bytes is None:
            self.fits, self.headroom_bytes = None, None
            return
        self.headroom_bytes = device_memory_bytes - self.peak_bytes - self.overhead_bytes
        self.fits = self.headroom_bytes >= 0

    def to_json(self) -> dict:
        data = {
            "schema": SCHEMA,
            "model": self.model, "num_parameters": self.num_parameters, "workload": self.workload,
            "method": self.method, "device": self.device, "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "at_peak": {k: int(self.at_peak[k]) for k in CATEGORIES},
            "component_peaks": {k: int(self.component_peaks[k]) for k in CATEGORIES},
            "model_state_bytes": {k: int(self.model_state_bytes[k]) for k in MODEL_STATE_CATEGORIES},
            "overhead_bytes": int(self.overhead_bytes), "host_bytes": int(self.host_bytes),
            "fits": self.fits, "headroom_bytes": self.headroom_bytes,
            "elapsed_s": round(self.elapsed_s, 4), "device_memory_bytes": self.device_memory_bytes,
            "sources": self.sources, "overhead_detail": self.overhead_detail, "notes": self.notes,
        }
        if self.paged_bytes:
            data["paged_bytes"] = self.paged_bytes
        if self.nvme_bytes:
            data["nvme_bytes"] = self.nvme_bytes
        if self.reserved_bytes is not None:
            data["reserved_bytes"] = self.reserved_bytes
            data["allocator"] = self.allocator
        if self.modules:
            data["modules"] = [asdict(m) for m in self.modules]
        if self.timeline is not None:
            data["timeline"] = self.timeline
        data.update(self.extra)
        return data

    @classmethod
    def from_json(cls, data: dict) -> MemoryEstimate:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document (schema={data.get('schema')!r})")
        known = {f for f in cls.__dataclass_fields__ if f not in ("modules", "extra")}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["modules"] = [ModuleMemory(**m) for m in data.get("modules", [])]
        kwargs["extra"] = {k: v for k, v in data.items() if k not in known and k not in ("schema", "modules")}
        return cls(**kwargs)
