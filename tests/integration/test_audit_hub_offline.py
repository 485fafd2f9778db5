"""A hub dataset input with the network gone (no offline flag; the hub endpoint a closed local port): `datasets`
falls back to its warm cache, and an id it does not hold is one line naming it (after huggingface_hub's retries,
~25 s: why this is an integration test). The cache is made offline as tests/helpers/audit.py describes.
"""

from __future__ import annotations

import pytest

from tests.helpers.audit import audit_stage_reads_cache_or_names_the_id, warm_hf_home


@pytest.mark.slow
def test_without_network_the_cache_is_read_and_a_missing_id_named(tmp_path):
    """No offline flag, the network gone (the hub endpoint a closed local port): `datasets` falls back to the
    cache; for an id it does not hold, the error names it (after huggingface_hub's retries, ~25 s)."""
    from tests.helpers.train import free_port

    _, base = warm_hf_home(tmp_path)
    audit_stage_reads_cache_or_names_the_id(tmp_path, {**base, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
