"""A run's request written from a template (services/replica_request.py) is, as Triton parses it, the
very message replica_client.build_request makes: for every combination of the options a run may
carry, prompts whose lengths need one, two and three bytes as varints, and templates reused across
requests of other options in between."""

from __future__ import annotations

import itertools

import pytest
from sluice.services import replica_client
from sluice.services.replica_request import RequestTemplates
from tritonclient.grpc import service_pb2

NAMES = ("end_id", "seed", "cache_salt", "temperature", "top_p", "perf_metrics", "streaming")
OPTIONS = [dict(zip(NAMES, values, strict=True))
           for values in itertools.product((None, 2), (None, 11), (0, 2**63 + 5), (None, 0.7), (None, 0.9),
                                           (True, False), (True, False))]


def parsed(request: bytes) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest.FromString(request)


@pytest.mark.parametrize("prompt_tokens", [1, 127, 128, 20_000])
def test_every_option_combination_parses_as_build_request_makes_it(prompt_tokens: int):
    templates = RequestTemplates()
    prompt = [(7 * index) % 50_000 for index in range(prompt_tokens)]
    for number, options in enumerate(OPTIONS):
        run_id = f"run-{number:04d}-{prompt_tokens}"
        made = templates.encode(run_id, prompt, 300, **options)   # type: ignore[arg-type]
        assert parsed(made) == replica_client.build_request(run_id, prompt, 300, **options)   # type: ignore[arg-type]


def test_the_template_of_some_options_is_not_reused_for_others():
    templates = RequestTemplates()
    plain = templates.encode("run-a", [1, 2, 3], 4)
    salted = templates.encode("run-b", [1, 2, 3], 4, cache_salt=9, end_id=2)
    assert parsed(templates.encode("run-a", [1, 2, 3], 4)) == parsed(plain)
    assert parsed(salted) == replica_client.build_request("run-b", [1, 2, 3], 4, 2, cache_salt=9)
    assert [tensor.name for tensor in parsed(salted).inputs][-2:] == ["end_id", "cache_salt_id"]


def test_build_request_still_carries_stop_words_and_stop():
    request = replica_client.build_request("run-s", [5], 4, stop=True, stop_words=[[1, 2]])
    assert [tensor.name for tensor in request.inputs][-2:] == ["stop_words_list", "stop"]
    assert request.raw_input_contents[-1] == b"\x01"
