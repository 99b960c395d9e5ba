"""The GPU catalog (bundled JSON): memory, throughput and bandwidth of the GPUs users rent; the CUDA caching
allocator's settings (PYTORCH_CUDA_ALLOC_CONF) a run uses on them."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from memfit.core.errors import MemfitError, closest
from memfit.core.units import GiB, MiB, format_bytes

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
    memory_source: str = ""     # where the CUDA-visible total comes from (gpus.json notes)
    rates_source: str = ""      # where the TFLOP/s, bandwidth and links come from

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
            "memory_source": self.memory_source, "rates_source": self.rates_source,
        }

    def with_memory(self, memory_bytes: int) -> GPU:
        """This GPU with the total the user gives (--gpu-memory: a MIG slice, ECC on or off, another driver)."""
        return dataclasses.replace(self, memory_bytes=memory_bytes, memory_source="given (--gpu-memory)")


@lru_cache(maxsize=1)
def _document() -> dict:
    """The bundled gpus.json, read once."""
    return json.loads(resources.files("memfit.specs").joinpath("gpus.json").read_text())


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPU]:
    raw = _document()
    catalog = {}
    for entry in raw["gpus"]:
        catalog[entry["name"]] = GPU(
            name=entry["name"], vendor=entry["vendor"],
            memory_bytes=entry.get("cuda_memory_bytes") or round(entry["cuda_memory_gib"] * GiB),
            fp32_tflops=entry["fp32_tflops"], bf16_tflops=entry["bf16_tflops"], fp16_tflops=entry["fp16_tflops"],
            memory_bandwidth_gbps=entry["memory_bandwidth_gbps"], interconnect=entry["interconnect"],
            interconnect_gbps=entry["interconnect_gbps"], host_link_gbps=entry["host_link_gbps"],
            context_bytes=entry["context_mib"] * MiB, compute_capability=tuple(entry["compute_capability"]),
            aliases=tuple(entry.get("aliases", ())), memory_source=entry.get("memory_source", ""),
            rates_source=entry.get("rates_source", ""),
        )
    return catalog


@lru_cache(maxsize=1)
def ambiguous_names() -> dict[str, tuple[str, ...]]:
    """Names that fit several catalog GPUs of different memory sizes ("a100": the 40 GB and the 80 GB card)."""
    return {name: tuple(gpus) for name, gpus in _document().get("ambiguous", {}).items()}


def get_gpu(name: str) -> GPU:
    key = name.strip().lower()
    catalog = gpu_catalog()
    if key in catalog:
        return catalog[key]
    for gpu in catalog.values():
        if key in gpu.aliases:
            return gpu
    if key in ambiguous_names():
        options = [catalog[n] for n in ambiguous_names()[key]]
        raise MemfitError(f"{name!r} names GPUs with different memory: "
                          + " or ".join(f"{g.name} ({format_bytes(g.memory_bytes)})" for g in options)
                          + "; name one.")
    names = list(catalog) + [a for g in catalog.values() for a in g.aliases]
    raise MemfitError(f"unknown GPU {name!r}; `memfit gpus` lists the catalog.{closest(key, names)}")


# Substrings of torch.cuda device names -> catalog entries, most specific first.
_DEVICE_NAME_MATCHES = (
    ("GH200 144G", "gh200-144gb"), ("GH200", "gh200-96gb"), ("H200", "h200-141gb"), ("H20", "h20"),
    ("H100 NVL", "h100-nvl-94gb"), ("H100 PCIe", "h100-pcie-80gb"), ("H100", "h100-sxm-80gb"), ("B200", "b200"),
    ("A100-SXM4-40GB", "a100-40gb"), ("A100-PCIE-40GB", "a100-40gb"), ("A100", "a100-80gb"),
    ("L40S", "l40s"), ("L40", "l40"), ("L4", "l4"), ("A10G", "a10g"), ("A10", "a10"),
    ("RTX 6000 Ada", "rtx-6000-ada"), ("RTX A6000", "rtx-a6000"), ("5090", "rtx-5090"), ("5080", "rtx-5080"),
    ("4090", "rtx-4090"), ("4080", "rtx-4080"), ("4070", "rtx-4070"), ("4060", "rtx-4060"), ("3090", "rtx-3090"),
    ("3060", "rtx-3060"), ("T4", "t4"), ("V100-SXM2-32GB", "v100-32gb"), ("V100", "v100-16gb"), ("MI300X", "mi300x"),
)


def gpu_of_device(device: str = "cuda:0") -> GPU:
    """The catalog entry for a local CUDA device, with the memory the driver reports."""
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return gpu_of_device_name(props.name, props.total_memory)


def gpu_of_device_name(name: str, memory_bytes: int) -> GPU:
    """The catalog entry for a CUDA device's name (torch.cuda.get_device_name), with `memory_bytes`."""
    for fragment, key in _DEVICE_NAME_MATCHES:
        if fragment in name:
            return dataclasses.replace(gpu_catalog()[key], memory_bytes=memory_bytes, memory_source="this device")
    return dataclasses.replace(gpu_catalog()["a100-80gb"], name=name, memory_bytes=memory_bytes,
                               memory_source="this device")
