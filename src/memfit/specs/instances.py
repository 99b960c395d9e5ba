"""Machines people rent (bundled JSON, instances.json): the GPUs they hold, host RAM, local NVMe, links, and an
on-demand list price with the date it held and the page it came from.

Prices are list prices (on demand, one region, no discounts) as their sources showed them on the date given:
providers change them, so every price carries its date and source, and `--price NAME=USD` replaces one.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources

from memfit.core.errors import MemfitError, closest
from memfit.core.units import GiB
from memfit.specs.hardware import GPU, get_gpu


@dataclass(frozen=True)
class Instance:
    name: str
    provider: str
    gpu: GPU
    gpus: int
    host_ram_bytes: int
    local_nvme_bytes: int | None      # None: network storage only
    gpu_link: str                     # between the machine's GPUs
    network_gbps: float | None        # between machines, Gbit/s
    usd_per_hour: float | None        # on-demand list price of the whole machine; None: not listed
    price_date: str | None
    price_source: str | None
    price_region: str | None
    note: str = ""

    def price_json(self) -> dict:
        return {"kind": "on-demand list price", "date": self.price_date, "source": self.price_source,
                "region": self.price_region}

    def to_json(self) -> dict:
        return {"name": self.name, "provider": self.provider, "gpu": self.gpu.name, "gpus": self.gpus,
                "host_ram_bytes": self.host_ram_bytes, "local_nvme_bytes": self.local_nvme_bytes,
                "gpu_link": self.gpu_link, "network_gbps": self.network_gbps, "usd_per_hour": self.usd_per_hour,
                "price": self.price_json(), "note": self.note}


@lru_cache(maxsize=1)
def instance_catalog() -> dict[str, Instance]:
    raw = json.loads(resources.files("memfit.specs").joinpath("instances.json").read_text())
    catalog = {}
    for entry in raw["instances"]:
        price = entry.get("price") or {}
        catalog[entry["name"].lower()] = Instance(
            name=entry["name"], provider=entry["provider"], gpu=get_gpu(entry["gpu"]), gpus=entry["gpus"],
            host_ram_bytes=int(entry["host_ram_gib"] * GiB),
            local_nvme_bytes=int(entry["local_nvme_gb"] * 10**9) if entry.get("local_nvme_gb") else None,
            gpu_link=entry["gpu_link"], network_gbps=entry.get("network_gbps"), usd_per_hour=price.get("usd_per_hour"),
            price_date=price.get("date"), price_source=price.get("source"), price_region=price.get("region"),
            note=entry.get("note", ""))
    return catalog


def get_instance(name: str) -> Instance:
    catalog = instance_catalog()
    key = name.strip().lower()
    if key in catalog:
        return catalog[key]
    starting = [catalog[k].name for k in catalog if k.startswith(key)]
    hint = f" Did you mean: {', '.join(starting[:4])}?" if starting else closest(key, catalog)
    raise MemfitError(f"unknown instance {name!r}; `memfit instances` lists the catalog (or plan with --gpu and "
                      f"--host-ram).{hint}")


def priced(instances: list[Instance], overrides: dict[str, float]) -> list[Instance]:
    """`instances` with the prices `--price NAME=USD` gives instead of the list prices."""
    unknown = [name for name in overrides if name.lower() not in instance_catalog()]
    if unknown:
        get_instance(unknown[0])   # its error names the catalog and the closest names
    by_name = {name.lower(): usd for name, usd in overrides.items()}
    return [replace(i, usd_per_hour=by_name[i.name.lower()], price_date="given", price_source="--price",
                    price_region=None) if i.name.lower() in by_name else i for i in instances]


def parse_price(text: str) -> tuple[str, float]:
    """'p5.48xlarge=55.04' -> ('p5.48xlarge', 55.04)."""
    name, _, usd = text.partition("=")
    try:
        value = float(usd.strip().lstrip("$"))
    except ValueError:
        value = -1.0
    if not name.strip() or value <= 0:
        raise MemfitError(f"--price {text!r}: write NAME=USD per hour, e.g. --price p5.48xlarge=55.04.")
    return name.strip(), value


def usual_host_ram(gpu: GPU, gpus_per_node: int) -> tuple[int, int] | None:
    """The least and most host RAM of the catalog's smallest machines that hold `gpus_per_node` of `gpu` (a 4090
    workstation or pod, a g6e.xlarge, not the 8-GPU node); None when no machine there holds them."""
    holding = [i for i in instance_catalog().values() if i.gpu.name == gpu.name and i.gpus >= gpus_per_node]
    if not holding:
        return None
    fewest = min(i.gpus for i in holding)
    rams = [i.host_ram_bytes for i in holding if i.gpus == fewest]
    return min(rams), max(rams)
