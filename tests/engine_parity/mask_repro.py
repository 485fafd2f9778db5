"""Minimal reproduction of Triton 3.9's interpreter mask bug (triton_env.py's docstring says why it happens): an
int1 & int1 mask, as vLLM's `_selector_walk_kernel` builds `mask & valid`, reaches `tl.load` as an integer array
and the interpreter refuses it ("mask has unsupported dtype"). The compiled kernel takes the same code.

Command (prints the outcome before and after the harness's fix):
    PYTHONPATH=build/triton:. .venv/bin/python -m tests.engine_parity.mask_repro
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates, so before the kernel below

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _copy_first_three(x_ptr, flag_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    both = (offsets < 3) & (tl.load(flag_ptr) >= 0)  # int1 & int1, as vLLM's `mask & valid`
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=both, other=0.0), mask=both)


def run() -> str:
    """'ok', or the error the interpreter raises / the wrong values it stores."""
    x, out = torch.arange(4, dtype=torch.float32), torch.zeros(4)
    try:
        _copy_first_three[(1,)](x, torch.zeros(1, dtype=torch.int64), out, BLOCK=4)
    except Exception as exc:  # noqa: BLE001 - the interpreter's error is the result
        return repr(exc)
    return "ok" if out.tolist() == [0.0, 1.0, 2.0, 0.0] else f"wrong values {out.tolist()}"


if __name__ == "__main__":
    from tests.engine_parity.triton_env import enable_interpreter

    print("before the fix:", run())
    enable_interpreter()
    print("after the fix: ", run())
