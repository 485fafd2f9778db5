"""Triton for vLLM's speculator kernels on CPU, kept out of the venv.

Why its own folder: installed into the venv, Triton breaks `import transformers` on this CPU torch (the Makefile's
setup removes it), so it lives in build/triton (git-ignored with build/) and only the parity subprocess puts it on
its path (`ensure_triton`, `subprocess_env`).

Inside that subprocess `enable_interpreter` must run before anything imports triton or vLLM's kernels:
  - TRITON_INTERPRET=1 is read when `@triton.jit` decorates a function (triton.language's own jit helpers such as
    tl.max included), so it is set first;
  - vllm.triton_utils finds Triton without a CPU backend and hands out placeholders; its `triton` / `tl` are pointed
    at the real modules, so the speculator modules imported afterwards get real kernels;
  - Triton 3.9's interpreter tags a comparison's result with its operand's dtype instead of int1
    (InterpreterBuilder.binary_op keeps `lhs.dtype.scalar`); the data stay numpy bool until the next bitwise op
    (`mask & valid` in vLLM's _selector_walk_kernel) casts them to that integer dtype, and `tl.load` then refuses
    the mask ("mask has unsupported dtype"). mask_repro.py shows it in one small kernel. The fix, here only:
    masked loads and stores read any integer mask as `!= 0` (what the compiled kernel does with an i1 mask).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TRITON_SPEC = "triton==3.9.*"


def triton_folder(repo: Path) -> Path:
    return repo / "build" / "triton"


def ensure_triton(repo: Path) -> str | None:
    """Install Triton into build/triton when it is not there -> None, or why it could not be installed. pip writes
    into a fresh folder that is renamed into place when complete, so an interrupted install is never taken."""
    folder = triton_folder(repo)
    if (folder / "triton" / "runtime" / "interpreter.py").is_file():
        return None
    staging = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging), TRITON_SPEC]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        return f"pip could not install {TRITON_SPEC} from PyPI into {folder}: {done.stderr.strip()[-400:]}"
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return None


def subprocess_env(repo: Path) -> dict[str, str]:
    """The environment of the parity subprocess: Triton's folder and the repository first on its path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(triton_folder(repo)), str(repo), env.get("PYTHONPATH", "")])
    env["TRITON_INTERPRET"] = "1"
    return env


def _bool_mask(handle):
    import numpy as np
    from triton.runtime import interpreter

    if handle.data.dtype == np.bool_:
        return handle
    return interpreter.TensorHandle(handle.data != 0, interpreter.tl.int1)


def enable_interpreter() -> None:
    """TRITON_INTERPRET, vllm.triton_utils on the real Triton, and integer masks read as booleans (docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils
    from triton.runtime import interpreter

    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_parity_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = lambda self, ptrs, mask, other, *a: load(self, ptrs, _bool_mask(mask), other, *a)
    builder.create_masked_store = lambda self, ptrs, value, mask, *a: store(self, ptrs, value, _bool_mask(mask), *a)
    builder._parity_masks = True


__all__ = ["TRITON_SPEC", "enable_interpreter", "ensure_triton", "subprocess_env"]
