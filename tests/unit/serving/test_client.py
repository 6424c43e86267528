"""`compare_outputs` and server URLs, on completions built by hand (no server needed)."""

from __future__ import annotations

import math

import pytest

from kv_offload.errors import ServingError
from kv_offload.serving.client import Completion, api_roots, compare_outputs


def completion(tokens: list[str], top: list[dict[str, float]]) -> Completion:
    return Completion(prompt_tokens=64, cached_tokens=32, tokens=tuple(tokens),
                      top_logprobs=tuple(top), seconds=0.1)


REFERENCE = completion(["t1", "t2", "t3"], [{"t1": -1.0, "t9": -2.0}, {"t2": -0.5, "t8": -3.0},
                                            {"t3": -0.25, "t7": -4.0}])


def test_a_completion_is_bit_identical_to_itself():
    diff = compare_outputs(REFERENCE, completion(list(REFERENCE.tokens),
                                                 [dict(s) for s in REFERENCE.top_logprobs]))
    assert diff.same_tokens and diff.same_candidates and diff.first_difference is None
    assert diff.max_logprob_diff == 0.0
    assert diff.identical(0.0)


def test_a_logprob_off_in_the_last_bits_is_not_identical_but_within_a_tolerance():
    top = [dict(s) for s in REFERENCE.top_logprobs]
    top[1]["t8"] = math.nextafter(-3.0, 0.0)
    diff = compare_outputs(REFERENCE, completion(list(REFERENCE.tokens), top))
    assert diff.same_tokens and 0 < diff.max_logprob_diff < 1e-12
    assert not diff.identical(0.0)
    assert diff.identical(1e-6)


def test_a_different_token_is_found_and_later_positions_are_not_compared():
    top = [dict(s) for s in REFERENCE.top_logprobs]
    top[1] = {"t8": -0.5, "t2": -0.5 - 1e-3}
    top[2] = {"x": -9.0, "t3": -7.0}  # another text from here on: not comparable
    diff = compare_outputs(REFERENCE, completion(["t1", "t8", "x"], top))
    assert (diff.same_tokens, diff.first_difference) == (False, 1)
    assert diff.max_logprob_diff == pytest.approx(2.5)  # t8 at position 1, not position 2
    assert not diff.identical(100.0)


def test_different_candidates_fail_exact_comparison_and_nothing_in_common_is_infinite():
    swapped = [dict(s) for s in REFERENCE.top_logprobs]
    swapped[0] = {"t1": -1.0, "t5": -2.0}
    diff = compare_outputs(REFERENCE, completion(list(REFERENCE.tokens), swapped))
    assert diff.same_tokens and not diff.same_candidates and diff.max_logprob_diff == 0.0
    assert not diff.identical(0.0) and diff.identical(1e-3)
    disjoint = [dict(s) for s in REFERENCE.top_logprobs]
    disjoint[2] = {"t5": -1.0}
    assert compare_outputs(REFERENCE, completion(list(REFERENCE.tokens),
                                                 disjoint)).max_logprob_diff == math.inf


def test_a_shorter_completion_differs_where_it_stops():
    diff = compare_outputs(REFERENCE, completion(["t1", "t2"], list(REFERENCE.top_logprobs[:2])))
    assert (diff.same_tokens, diff.first_difference) == (False, 2)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/",
                                 "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"])
def test_server_urls_are_accepted_with_or_without_the_api_path(url):
    assert api_roots(url) == ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1")


def test_a_server_url_without_a_scheme_is_refused_by_name():
    with pytest.raises(ServingError, match="127.0.0.1:8000.*http://"):
        api_roots("127.0.0.1:8000")


def test_completions_survive_a_json_round_trip():
    assert Completion.from_json(REFERENCE.to_json()) == REFERENCE
