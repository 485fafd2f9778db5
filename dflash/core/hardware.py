"""Hardware profiles: what a device can do, read strictly from a profiles file (`plan.hardware_file`).

A profile is one device type: its memory, memory bandwidth, dense matmul peaks, interconnect and price, with the
source of those numbers. GPU profiles (params/hardware.yaml) hold vendor peaks; a CPU host profile holds what
benchmarks/hw_probe.py measured on that host, so the demo's plan prices the machine it runs on. The plan
(dflash/plan/) prices generation and training on a profile; the training pilot (dflash/train/pilot.py) divides
its measured FLOP rate by the profile of the device it ran on (its MFU). Stdlib + the one YAML reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash.core.errors import UserError
from dflash.core.loader import read_yaml

KINDS = ("gpu", "cpu")
_PROFILE_KEYS = {
    "name": str,
    "kind": str,
    "memory_gb": float,
    "bandwidth_tbps": float,
    "bf16_tflops": float,
    "fp32_tflops": float,
    "interconnect": str,
    "interconnect_gbps": float,
    "price_per_gpu_hour": float,
    "source": str,
}
_TORCH_DTYPES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "bf16",
    "float16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
}


@dataclass(frozen=True)
class GpuProfile:
    """One device type (a GPU, or a CPU host measured by benchmarks/hw_probe.py)."""

    key: str  # the profile's name in the hardware file
    name: str  # marketing name (CPU host: the processor's model name)
    kind: str  # gpu | cpu
    memory_gb: float  # device memory (GB = 1e9 bytes; CPU host: RAM)
    bandwidth_tbps: float  # memory bandwidth (TB/s): vendor peak (GPU), measured copy rate (CPU host)
    bf16_tflops: float  # dense BF16 matmul peak (TFLOP/s): tensor cores (GPU), measured (CPU host)
    fp32_tflops: float  # dense FP32 matmul peak (TFLOP/s); 0 = unknown (GPUs run bf16 here)
    interconnect: str  # device-to-device link
    interconnect_gbps: float  # GB/s per direction between two devices
    price_per_gpu_hour: float  # USD; 0 = unknown
    source: str  # where these numbers come from

    def matmul_tflops(self, dtype: str, where: str) -> float:
        """The dense matmul peak for a compute dtype (bf16 / fp16 share the tensor-core rate), refusing an
        unknown (0) fp32 figure with the file key to set."""
        kind = _TORCH_DTYPES.get(dtype)
        if kind is None:
            raise UserError(f"{where}: no matmul rate for dtype {dtype!r} (known: {', '.join(_TORCH_DTYPES)})")
        rate = self.bf16_tflops if kind == "bf16" else self.fp32_tflops
        if rate <= 0:
            raise UserError(
                f"profiles.{self.key}.fp32_tflops: 0 (unknown) but {where} computes in {dtype}: set the profile's "
                "fp32 rate (python benchmarks/hw_probe.py measures one) or compute in bfloat16"
            )
        return rate

    def matches(self, device_type: str, device_name: str) -> bool:
        """Whether a device the code ran on is this profile: a CPU matches a cpu profile; a GPU matches a gpu
        profile whose key names it (h200 in "NVIDIA H200", rtx-pro-6000 in "NVIDIA RTX PRO 6000 Blackwell ...")."""
        if device_type == "cpu":
            return self.kind == "cpu"
        token = "".join(c for c in self.key.upper().replace("-SXM", "") if c.isalnum())
        return self.kind == "gpu" and bool(token) and token in "".join(c for c in device_name.upper() if c.isalnum())


def load_hardware(path: str | Path) -> dict[str, GpuProfile]:
    """Read the profiles file strictly: every key present, numbers positive, nothing unknown."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"plan.hardware_file: {path} does not exist")
    data = read_yaml(path, "GPU profiles file (plan.hardware_file)")  # DVC's YAML reading; ParamsError naming the file
    profiles = data.get("profiles")
    if not isinstance(profiles, dict) or not profiles:
        raise UserError(f"{path}: expected a top-level `profiles:` mapping of name -> profile")
    out = {}
    for key, prof in profiles.items():
        where = f"{path}: profiles.{key}"
        if not isinstance(prof, dict):
            raise UserError(f"{where}: expected a mapping")
        unknown = sorted(set(prof) - set(_PROFILE_KEYS), key=str)
        if unknown:
            raise UserError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(_PROFILE_KEYS)})")
        values = {}
        for name, tp in _PROFILE_KEYS.items():
            if name not in prof:
                raise UserError(f"{where}.{name}: missing key")
            value = prof[name]
            if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, tp):
                raise UserError(f"{where}.{name}: expected {tp.__name__}, got {value!r}")
            values[name] = value
        if values["kind"] not in KINDS:
            raise UserError(f"{where}.kind: expected one of {', '.join(KINDS)}, got {values['kind']!r}")
        for name in ("memory_gb", "bandwidth_tbps", "bf16_tflops"):
            if not values[name] > 0:
                raise UserError(f"{where}.{name}: must be > 0, got {values[name]}")
        for name in ("fp32_tflops", "interconnect_gbps", "price_per_gpu_hour"):
            if not values[name] >= 0:
                raise UserError(f"{where}.{name}: must be >= 0, got {values[name]}")
        out[key] = GpuProfile(key=key, **values)
    return out


def select_gpu(profiles: dict[str, GpuProfile], name: str, file: str) -> GpuProfile:
    if name not in profiles:
        raise UserError(f"plan.hardware: no profile {name!r} in {file} (have: {', '.join(profiles)})")
    return profiles[name]


def profile_for_device(
    profiles: dict[str, GpuProfile], preferred: str, device_type: str, device_name: str
) -> GpuProfile | None:
    """The profile of the device a measurement ran on: `preferred` (plan.hardware) when it matches, else the
    first profile of the file that does, else None."""
    first = [profiles[preferred]] if preferred in profiles else []
    for prof in first + [p for k, p in profiles.items() if k != preferred]:
        if prof.matches(device_type, device_name):
            return prof
    return None
