"""Generate's search for a prompt that kills its engine (no engine: the dispatcher's bisection alone): at each
death the search narrows to the requests that were in the engine. The real engine against a poisoned prompt:
tests/integration/test_generate_poison.py."""

from __future__ import annotations

from dflash.generate import contract
from dflash.generate.engines_backend import EnginesDispatcher
from tests.helpers import repo_params


def test_the_search_narrows_to_the_requests_in_the_engine_at_each_death(tmp_path):
    """The dispatcher's rule, death by death: a plain retry first; from the second death on, the requests that
    were in the engine are the suspects; one request alone in the engine at a death is the failed turn."""
    g = repo_params(["generate.unit_retries=1", "generate.engine_start_retries=1"]).generate
    d = EnginesDispatcher([], None, g, 0, 0)
    unit = contract.Unit(3, [], "unit-3.arrow")
    unit.attempts = 1
    d._narrow(unit, {"a:0", "b:0", "c:0", "d:0"}, 17)
    assert unit.suspects == [] and unit.failed_turns == {}  # once may be bad luck: retried alone as it is
    unit.attempts = 2
    d._narrow(unit, {"d:0", "a:0", "b:0", "c:0"}, 17)
    assert unit.suspects == ["a:0", "b:0", "c:0", "d:0"]
    unit.attempts = 3
    d._narrow(unit, {"a:0", "b:0"}, 17)  # the first half went in and the engine died
    assert unit.suspects == ["a:0", "b:0"]
    unit.done_rows = [{"sample_id": "a:0"}]  # a:0 finished: the second half (b:0) went in alone and killed it
    unit.attempts = 4
    d._narrow(unit, {"b:0"}, 17)
    assert unit.suspects == [] and unit.failed_turns["b:0"]["reason"] == "engine_died"
    assert "alone in it (exit code 17" in unit.failed_turns["b:0"]["error"]
    assert d.failed_turns == [{"sample_id": "b:0", **unit.failed_turns["b:0"]}]
