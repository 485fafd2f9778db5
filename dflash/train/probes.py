"""What the training pilot (dflash/train/pilot.py) measures around the real trainer, without changing it.

  PeakMemory        peak memory per device over a phase: CUDA max allocated / reserved (reset per phase); CPU the
                    process's peak resident set (VmHWM, reset per phase through /proc/self/clear_refs)
  TimedFeatures     wraps the trainer's TargetFeatures: times each target forward and checks what it hands the
                    drafter, per hooked layer: finite and not all zero (norms kept for the report)
  attention_path    which drafter attention path and kernels ran (flex compiled or dense SDPA, torch.compile and its
                    graph breaks); `linear_attention_kernels` whether a hybrid target's Gated DeltaNet layers run
                    fused (fla) kernels or the torch fallback
  out_of_memory     whether an exception is an out-of-memory (CUDA, or a CPU allocation refused by the OS or an
                    address-space limit), and the memory in use when it happened

Timing on CUDA synchronizes the device before and after the timed call, so a phase's time is its own.
"""

from __future__ import annotations

import inspect
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.core.errors import UserError

GB = 1e9
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_gb() -> float | None:
    """The process's resident set now (GB), None off Linux."""
    kb = _status_kb("VmRSS")
    return kb * 1024 / GB if kb is not None else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory of the devices a phase used, from `start()` to `read()`."""

    def __init__(self, devices: list[torch.device]):
        self.devices = list(dict.fromkeys(devices))  # target and drafter device, once each
        self.cpu_reset = False

    def start(self) -> None:
        for dev in self.devices:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
        if any(dev.type == "cpu" for dev in self.devices):
            try:  # "5" resets the peak resident set size (Linux >= 4.0); else the process-lifetime peak is read
                _CLEAR_REFS.write_text("5")
                self.cpu_reset = True
            except OSError:
                self.cpu_reset = False

    def read(self) -> dict[str, dict]:
        out = {}
        for dev in self.devices:
            if dev.type == "cuda":
                total = torch.cuda.get_device_properties(dev).total_memory
                out[str(dev)] = {
                    "max_allocated_gb": torch.cuda.max_memory_allocated(dev) / GB,
                    "max_reserved_gb": torch.cuda.max_memory_reserved(dev) / GB,
                    "total_gb": total / GB,
                }
            else:
                hwm = _status_kb("VmHWM")
                peak = hwm * 1024 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                out[str(dev)] = {
                    "peak_rss_gb": peak / GB,
                    "measure": "VmHWM since the phase began" if self.cpu_reset and hwm is not None else "process peak",
                }
        return out


def peak_gb(memory: dict[str, dict]) -> float:
    """The largest peak of a `PeakMemory.read()` (CUDA: reserved, what the allocator holds; CPU: resident set)."""
    return max((m.get("max_reserved_gb", m.get("peak_rss_gb", 0.0)) for m in memory.values()), default=0.0)


class FeatureProblem(UserError):
    """A hooked target layer gives the drafter nothing usable (all zero, NaN or inf)."""


class TimedFeatures:
    """The trainer's TargetFeatures with a timer and a check of each hooked layer's hidden states."""

    def __init__(self, inner, layer_ids: list[int], hidden_size: int, device: torch.device):
        self.inner, self.layer_ids, self.hidden, self.device = inner, list(layer_ids), hidden_size, device
        self.seconds = 0.0
        self.norms: list[list[float]] = []  # per call: RMS of each hooked layer's features
        self.where = ""  # the pilot's current rows, for the message

    def __call__(
        self, input_ids: torch.Tensor, doc_starts: list[int], doc_lengths: list[int]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.inner(input_ids, doc_starts, doc_lengths)
        _sync(self.device)
        self.seconds += time.perf_counter() - t0
        feats = out[0] if isinstance(out, tuple) else out
        self.check(feats.detach())
        if isinstance(out, tuple):
            self.check_final(out[1].detach())
        return out

    def check(self, feats: torch.Tensor) -> None:
        per_layer = feats.float().reshape(feats.shape[0], len(self.layer_ids), self.hidden)
        rms = per_layer.pow(2).mean(dim=(0, 2)).sqrt()
        finite = torch.isfinite(per_layer).all(dim=2).all(dim=0)  # (K,)
        peak = per_layer.abs().amax(dim=(0, 2))
        for k, lid in enumerate(self.layer_ids):
            if not bool(finite[k]):
                raise FeatureProblem(
                    f"train pilot: target layer {lid} (drafter.target_layer_ids[{k}]) gives NaN or inf hidden states "
                    f"at the {self.where} rows: the drafter would learn from garbage; check the target's dtype "
                    "(train.dtype) and weights"
                )
            if float(peak[k]) == 0.0:
                raise FeatureProblem(
                    f"train pilot: target layer {lid} (drafter.target_layer_ids[{k}]) gives all-zero hidden states at "
                    f"the {self.where} rows: the drafter would learn from nothing (a hook or a hybrid target's "
                    "extraction returning zeros); check the target's weights and drafter.target_layer_ids"
                )
        self.norms.append([float(x) for x in rms])

    def check_final(self, final: torch.Tensor) -> None:
        if not bool(torch.isfinite(final).all()) or float(final.abs().max()) == 0.0:
            raise FeatureProblem(
                f"train pilot: the target's final hidden states (train.loss_target needs them) are all zero, NaN or "
                f"inf at the {self.where} rows; check the target's weights and train.dtype"
            )


def _implementation(fn: Callable) -> Callable:
    """What a transformers kernel wrapper calls (its `implementation` closure variable), else `fn` itself."""
    seen = set()
    while callable(fn) and id(fn) not in seen:
        seen.add(id(fn))
        try:
            inner = inspect.getclosurevars(fn).nonlocals.get("implementation")
        except (TypeError, ValueError):
            return fn
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def linear_attention_kernels(model: torch.nn.Module) -> dict | None:
    """A hybrid target's Gated DeltaNet kernels: the chunked delta rule and causal conv its layers call (fla's
    fused Triton kernels, or transformers' torch fallback). None for a target without such layers."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if not layers:
        return None
    modeling = sys.modules[type(layers[0]).__module__]
    out: dict = {"layers": len(layers)}
    for key, attr in (
        ("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
        ("causal_conv1d", "causal_conv1d_fn"),
    ):
        fn = getattr(layers[0], "chunk_gated_delta_rule", None) if key == "chunk_gated_delta_rule" else None
        fn = _implementation(fn or getattr(modeling, attr, None))
        out[key] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}" if fn is not None else None
    out["fused"] = bool(out["chunk_gated_delta_rule"] and out["chunk_gated_delta_rule"].startswith("fla."))
    return out


def attention_path(backend: str, compiled_drafter: bool) -> dict:
    """The drafter's attention path as it ran: the backend, whether the flex kernel and the BlockMask builder were
    compiled (they are on CUDA once used), and torch.compile's graphs and graph breaks (a compile that fell back
    to eager captures no graph)."""
    from dflash.drafter import layers, masks

    out = {
        "backend": backend,
        "mask": "flex BlockMask" if backend == "flex" else "dense bool mask (SDPA)",
        "flex_kernel_compiled": layers._compiled_flex is not None,
        "block_mask_compiled": masks._compiled_create_block_mask is not None,
        "drafter_compiled": compiled_drafter,
    }
    if compiled_drafter:
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"].get("unique_graphs", 0))
        out["compiled_graphs"] = graphs
        out["graph_breaks"] = int(sum(counters["graph_break"].values()))
        out["compile_fell_back"] = graphs == 0
    return out


_CPU_OOM = ("can't allocate memory", "cannot allocate memory", "not enough memory", "std::bad_alloc")


def out_of_memory(exc: BaseException) -> bool:
    """An allocation the device or the OS refused (CUDA OOM, a CPU allocator failure, Python's MemoryError)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _CPU_OOM)


def memory_in_use(devices: list[torch.device]) -> str:
    """The memory in use at a failure, in words: CUDA allocated / reserved of each device; the process's resident
    set and its address-space limit on CPU."""
    parts = []
    for dev in dict.fromkeys(devices):
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory / GB
            parts.append(
                f"{dev}: {torch.cuda.memory_allocated(dev) / GB:.2f} GB allocated, "
                f"{torch.cuda.memory_reserved(dev) / GB:.2f} GB reserved of {total:.1f} GB"
            )
        else:
            rss = rss_gb()
            limit = resource.getrlimit(resource.RLIMIT_AS)[0]
            cap = f", address space limited to {limit / GB:.2f} GB" if limit != resource.RLIM_INFINITY else ""
            parts.append(f"cpu: {rss:.2f} GB resident{cap}" if rss is not None else f"cpu{cap}")
    return "; ".join(parts)


def host_memory_gb() -> float | None:
    """The host's RAM (MemTotal, GB), None off Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        return None
    return None


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what the platform module knows."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """What a device is, for reports and for matching a hardware profile (dflash/core/hardware.py)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"
