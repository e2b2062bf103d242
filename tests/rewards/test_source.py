"""The reward-source interface: what a source may return, and the message when it returns something else."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mmrl.rewards.source import RewardSourceError, SampleFailure, check_source_results


def test_score_dicts_and_failures_pass_and_numbers_become_floats():
    results = check_source_results(
        "judge", [{"overall": 1, "yes": np.float32(1.0)}, SampleFailure("HTTP 503 after 4 tries")], 2
    )
    assert results == [{"overall": 1.0, "yes": 1.0}, SampleFailure("HTTP 503 after 4 tries")]
    assert all(type(value) is float for value in results[0].values())


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        ({"overall": 1.0}, "returned dict; expected a list of 1"),
        ([], "returned 0 results for 1 inputs"),
        ([{"score": 1.0}], "for sample 0; expected a score dict with 'overall'"),
        ([{"overall": float("nan")}], "'overall' = nan for sample 0"),
        ([{"overall": "1"}], "'overall' = '1' for sample 0"),
        ([SampleFailure("")], "failed sample 0 without a reason"),
    ],
)
def test_malformed_results_name_the_source_and_sample(results, expected):
    with pytest.raises(RewardSourceError, match="reward source 'sandbox'") as err:
        check_source_results("sandbox", results, 1)
    assert expected in str(err.value)
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)  # crosses Ray unchanged
