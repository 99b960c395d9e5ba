"""The GPU catalog (bundled JSON): memory, throughput and bandwidth of the GPUs users rent; the CUDA caching
allocator's settings (PYTORCH_CUDA_ALLOC_CONF) a run uses on them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from memfit.core.errors import MemfitError, closest
from memfit.core.units import MiB

CPU_KERNELS = (0, 0)   # the capability that stands for a CPU's own kernels (no CUDA to emulate)


@dataclass(frozen=True)
class GPU:
    name: str
    vendor: str
    memory_bytes: int
    fp32_tflops: float
    bf16_tflops: float | None
    fp16_tflops: float
    memory_bandwidth_gbps: float
    interconnect: str
    interconnect_gbps: float
    host_link_gbps: float
    context_bytes: int          # outside PyTorch's allocator; an assumed figure (see gpus.json notes)
    compute_capability: tuple[int, int] = (8, 0)
    aliases: tuple[str, ...] = ()

    @property
    def kernels(self) -> tuple[int, int]:
        """Which kernels a step runs here, as the step-time model's kernel count reads it: the CUDA kernels of its
        compute capability, or on a CPU (vendor "cpu", a planner oracle's) the CPU's own (CPU_KERNELS)."""
        return CPU_KERNELS if self.vendor == "cpu" else self.compute_capability

    def to_json(self) -> dict:
        return {
            "name": self.name, "vendor": self.vendor, "memory_bytes": self.memory_bytes,
            "fp32_tflops": self.fp32_tflops, "bf16_tflops": self.bf16_tflops, "fp16_tflops": self.fp16_tflops,
            "memory_bandwidth_gbps": self.memory_bandwidth_gbps, "interconnect": self.interconnect,
            "interconnect_gbps": self.interconnect_gbps, "host_link_gbps": self.host_link_gbps,
            "context_bytes": self.context_bytes, "context_source": "assumed",
            "compute_capability": list(self.compute_capability),
        }


@dataclass(frozen=True)
class AllocatorSettings:
    """PYTORCH_CUDA_ALLOC_CONF, as far as estimators/caching_allocator.py simulates it."""

    expandable_segments: bool = False
    max_split_size: int | None = None   # bytes (max_split_size_mb); None: no limit
    empty_cache_between_phases: bool = False   # torch.cuda.empty_cache() as each phase starts (release-cache)
    empty_cache_before_step: bool = False      # the cache emptied before the measured step: CUDA graphs' capture
    #                                            in the warm-up (compile:mode=reduce-overhead) calls empty_cache


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPU]:
    raw = json.loads(resources.files("memfit.specs").joinpath("gpus.json").read_text())
    catalog = {}
    for entry in raw["gpus"]:
        catalog[entry["name"]] = GPU(
            name=entry["name"], vendor=entry["vendor"], memory_bytes=entry["memory_mib"] * MiB,
            fp32_tflops=entry["fp32_tflops"], bf16_tflops=entry["bf16_tflops"], fp16_tflops=entry["fp16_tflops"],
            memory_bandwidth_gbps=entry["memory_bandwidth_gbps"], interconnect=entry["interconnect"],
            interconnect_gbps=entry["interconnect_gbps"], host_link_gbps=entry["host_link_gbps"],
            context_bytes=entry["context_mib"] * MiB, compute_capability=tuple(entry["compute_capability"]),
            aliases=tuple(entry.get("aliases", ())),
        )
    return catalog


def get_gpu(name: str) -> GPU:
    key = name.strip().lower()
    catalog = gpu_catalog()
    if key in catalog:
        return catalog[key]
    for gpu in catalog.values():
        if key in gpu.aliases:
            return gpu
    names = list(catalog) + [a for g in catalog.values() for a in g.aliases]
    raise MemfitError(f"unknown GPU {name!r}; `memfit gpus` lists the catalog.{closest(key, names)}")


# Substrings of torch.cuda device names -> catalog entries, most specific first.
_DEVICE_NAME_MATCHES = (
    ("H200", "h200-141gb"), ("H100 PCIe", "h100-pcie-80gb"), ("H100", "h100-sxm-80gb"),
    ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"), ("A100", "a100-80gb"),
    ("L40S", "l40s"), ("L4", "l4"), ("A10G", "a10g"), ("4090", "rtx-4090"), ("3090", "rtx-3090"),
    ("T4", "t4"), ("V100-SXM2-32GB", "v100-32gb"), ("V100", "v100-16gb"), ("MI300X", "mi300x"),
)


def gpu_of_device(device: str = "cuda:0") -> GPU:
    """The catalog entry for a local CUDA device, with the memory the driver reports."""
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return gpu_of_device_name(props.name, props.total_memory)


def gpu_of_device_name(name: str, memory_bytes: int) -> GPU:
    """The catalog entry for a CUDA device's name (torch.cuda.get_device_name), with `memory_bytes`."""
    import dataclasses

    for fragment, key in _DEVICE_NAME_MATCHES:
        if fragment in name:
            return dataclasses.replace(gpu_catalog()[key], memory_bytes=memory_bytes)
    return dataclasses.replace(gpu_catalog()["a100-80gb"], name=name, memory_bytes=memory_bytes)
