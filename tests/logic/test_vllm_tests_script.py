"""scripts/vllm_entrypoint_tests.py's own logic: what counts as a regression, what pdserve is
given to run, and the exceptions, each with its reason."""

from __future__ import annotations

import json

from tests.helpers.vllm_tests import script

COMPLETION = "tests/entrypoints/openai/completion/test_completion.py"


def test_a_regression_is_a_pass_on_vllm_that_pdserve_does_not_pass_and_did_not_expect():
    vllm = {
        f"{COMPLETION}::test_single_completion": "passed",
        f"{COMPLETION}::test_zero_logprobs": "passed",
        f"{COMPLETION}::test_batch_completions[opt]": "passed",  # beam search: expected
        f"{COMPLETION}::test_other_models_text": "failed",
        f"{COMPLETION}::test_skipped": "skipped",
    }
    pdserve = {
        f"{COMPLETION}::test_single_completion": "passed",
        f"{COMPLETION}::test_batch_completions[opt]": "failed",
    }  # test_zero_logprobs did not run on pdserve: that is a regression too
    assert script().regressions(vllm, pdserve) == [f"{COMPLETION}::test_zero_logprobs"]
    assert script().passed(vllm) == {
        f"{COMPLETION}::test_single_completion",
        f"{COMPLETION}::test_zero_logprobs",
        f"{COMPLETION}::test_batch_completions[opt]",
    }
    assert "beam search" in script().expected(f"{COMPLETION}::test_batch_completions[opt]")
    assert script().expected(f"{COMPLETION}::test_single_completion") is None


def test_every_exception_and_left_out_test_says_why():
    for listed in (script().EXPECTED, script().DESELECTED):
        for test_id, why in listed.items():
            assert len(why.split()) >= 5, test_id
    for test_id in script().DESELECTED:  # a node id under one of the chosen modules
        assert test_id.split("::")[0] in script().MODULES, test_id


def test_compare_exits_nonzero_on_a_regression_and_names_it(tmp_path, capsys):
    vllm, pdserve = tmp_path / "vllm.json", tmp_path / "pdserve.json"
    vllm.write_text(
        json.dumps({f"{COMPLETION}::test_a": "passed", f"{COMPLETION}::test_b": "passed"})
    )
    pdserve.write_text(json.dumps({f"{COMPLETION}::test_a": "passed"}))
    assert script().main(["--compare", str(vllm), str(pdserve)]) == 1
    assert f"REGRESSED: {COMPLETION}::test_b" in capsys.readouterr().out
    pdserve.write_text(vllm.read_text())
    assert script().main(["--compare", str(vllm), str(pdserve)]) == 0
