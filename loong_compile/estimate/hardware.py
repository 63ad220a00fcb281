"""Hardware profiles: what the memory rule and the cost model need to know about a cluster.

Bandwidths are per direction in GB/s (1e9 bytes/s), memory in GiB (2**30 bytes,
the unit the 4D-estimator paper's tables use).  Every constant has its value and public
source in docs/estimator.md (calibration table); every profile field can be overridden
(``load_hardware(..., **overrides)``, ``loong plan --gpu-opt key=value``) or given in a JSON
file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from loong_compile.errors import LoongConfigError
from loong_compile.estimate.json_input import read_json_object


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One GPU type in one node layout.

    memory_gib: GPU memory (GiB).  gpus_per_node / nics_per_node: node layout; the
    NICs are shared by the node's GPUs (rail-optimised, one flow per NIC at full rate).
    nic_gbps: one NIC's bandwidth.  nvlink_gbps: one GPU's NVLink bandwidth.
    hbm_gbps: device memory bandwidth (merges of partial attention outputs, elementwise ops).
    peak_tflops: dense bf16 peak.  attention_efficiency: the fraction of peak FlashAttention
    reaches on long blocks; attention_half_block: the block length (tokens per ring step) at
    which it reaches half of that (short blocks do not fill the GPU).  matmul_efficiency:
    fraction of peak of large GEMMs.  pcie_gbps: host<->device copy bandwidth (MEMO's B).
    host_memory_gib: host memory per node (MEMO's M_CPU).  intra_latency_us /
    inter_latency_us: per-message latency on NVLink / the network.
    """

    name: str
    memory_gib: float
    gpus_per_node: int
    nics_per_node: int
    nic_gbps: float
    nvlink_gbps: float
    hbm_gbps: float
    peak_tflops: float
    attention_efficiency: float = 0.73
    attention_half_block: float = 1024.0
    matmul_efficiency: float = 0.8
    pcie_gbps: float = 25.0
    host_memory_gib: float = 2048.0
    intra_latency_us: float = 3.0
    inter_latency_us: float = 30.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name == "name":
                continue
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise LoongConfigError(f"hardware {self.name!r}: {field.name}={value!r}",
                                       f"{field.name} must be a number", f"give {field.name} a number")
            floor_ok = value >= 0 if field.name.endswith("_us") else value > 0
            if not floor_ok:
                raise LoongConfigError(f"hardware {self.name!r}: {field.name}={value!r}",
                                       f"{field.name} must be > 0" if not field.name.endswith("_us")
                                       else f"{field.name} must be >= 0",
                                       f"give {field.name} a positive value")
        for field in ("gpus_per_node", "nics_per_node"):
            if int(getattr(self, field)) != getattr(self, field):
                raise LoongConfigError(f"hardware {self.name!r}: {field}={getattr(self, field)!r}",
                                       f"{field} must be an integer", f"give {field} a whole number")
        for field in ("attention_efficiency", "matmul_efficiency"):
            if getattr(self, field) > 1:
                raise LoongConfigError(f"hardware {self.name!r}: {field}={getattr(self, field)!r}",
                                       f"{field} is a fraction of peak, in (0, 1]",
                                       f"give {field} e.g. 0.5")

    def gpus_in_node(self, gpus: int) -> int:
        """How many of a run's ``gpus`` share one node's host memory (the fullest node)."""
        return min(gpus, self.gpus_per_node)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Datasheet figures and the measurements cited in docs/estimator.md.  "a100" is LoongTrain's
# testbed (§6.1: 8 A100-80GB per node, NVLink, 4 HDR 200 Gb/s NICs); "a800" MEMO's (§5.1:
# NVLink 400 GB/s, InfiniBand 200 GB/s per node, 2 TB host memory, 32 GB/s GPU-CPU);
# "a100-40gb" and "h100-94gb" (4 GPUs per node) are the 4D-estimator paper's machines.
# Network layouts of DGX H100 / HGX H200: 8 NDR 400 Gb/s NICs per node.  On Hopper the
# backend's flash-attn 2 reaches 35 % of peak (FlashAttention-3 paper).  Memory is what the
# driver reports, in GiB.
PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    HardwareProfile("a100", memory_gib=80, gpus_per_node=8, nics_per_node=4, nic_gbps=25,
                    nvlink_gbps=300, hbm_gbps=2039, peak_tflops=312, pcie_gbps=25),
    HardwareProfile("a800", memory_gib=80, gpus_per_node=8, nics_per_node=8, nic_gbps=25,
                    nvlink_gbps=200, hbm_gbps=2039, peak_tflops=312, pcie_gbps=32),
    HardwareProfile("a100-40gb", memory_gib=40, gpus_per_node=8, nics_per_node=4, nic_gbps=25,
                    nvlink_gbps=300, hbm_gbps=1555, peak_tflops=312, pcie_gbps=25),
    HardwareProfile("h100", memory_gib=80, gpus_per_node=8, nics_per_node=8, nic_gbps=50,
                    nvlink_gbps=450, hbm_gbps=3350, peak_tflops=989, pcie_gbps=50,
                    attention_efficiency=0.35),
    HardwareProfile("h100-94gb", memory_gib=94, gpus_per_node=4, nics_per_node=4, nic_gbps=25,
                    nvlink_gbps=450, hbm_gbps=3900, peak_tflops=989, pcie_gbps=50,
                    attention_efficiency=0.35),
    HardwareProfile("h200", memory_gib=140, gpus_per_node=8, nics_per_node=8, nic_gbps=50,
                    nvlink_gbps=450, hbm_gbps=4800, peak_tflops=989, pcie_gbps=50,
                    attention_efficiency=0.35),
)}

FIELDS = tuple(f.name for f in dataclasses.fields(HardwareProfile) if f.name != "name")
_REQUIRED = tuple(f.name for f in dataclasses.fields(HardwareProfile)
                  if f.default is dataclasses.MISSING and f.name != "name")


def load_hardware(name_or_path: str, **overrides: float) -> HardwareProfile:
    """A preset (``PROFILES``) or a JSON file with the profile's fields; ``overrides`` replace fields."""
    key = name_or_path.strip().lower()
    if key in PROFILES:
        base = PROFILES[key].as_dict()
    elif Path(name_or_path).suffix == ".json" or Path(name_or_path).exists():
        base = _read_json(Path(name_or_path))
    else:
        raise LoongConfigError(f"unknown GPU {name_or_path!r}",
                               f"a GPU is one of {', '.join(PROFILES)} or a JSON profile path",
                               "pick a preset or pass --gpu path/to/profile.json")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise LoongConfigError(f"unknown hardware field(s) {', '.join(unknown)}",
                               f"fields are {', '.join(FIELDS)}", "correct the field name")
    base.update(overrides)
    missing = [f for f in _REQUIRED if f not in base]
    if missing:
        what = "capacity (memory_gib)" if missing == ["memory_gib"] else ", ".join(missing)
        raise LoongConfigError(f"hardware {base.get('name', name_or_path)!r} is missing {what}",
                               f"a profile needs {', '.join(_REQUIRED)}",
                               "add the missing fields to the profile or pass them as overrides")
    return HardwareProfile(**base)


def _read_json(path: Path) -> dict:
    data = read_json_object(path, "hardware profile", 'a JSON object of profile fields, e.g. {"memory_gib": 80, ...}')
    unknown = sorted(set(data) - set(FIELDS) - {"name"})
    if unknown:
        raise LoongConfigError(f"hardware profile {str(path)!r}: unknown field(s) {', '.join(unknown)}",
                               f"fields are {', '.join(FIELDS)}", "correct the field names")
    data.setdefault("name", path.stem)
    return data
