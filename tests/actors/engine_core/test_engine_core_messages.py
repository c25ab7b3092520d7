"""The engine-core wire: every message survives encode/decode as the same typed dataclass (nested
dataclasses, dicts with int keys, bytes), only allow-listed types are built, and the
data-parallel layouts that cannot be served are refused with the flag to fix."""

from __future__ import annotations

import msgpack
import pytest

from pagedserve.actors.beam.search import BeamHypothesis, BeamSearchOutput
from pagedserve.actors.dp.config import DataParallelConfig
from pagedserve.actors.engine.protocol import GenerationDelta
from pagedserve.actors.engine_core import messages as m
from pagedserve.actors.errors import DuplicateRequestId, EngineError, EngineOverloaded
from pagedserve.actors.kv.events import BlockStored, EngineLoad, KVEventBatch
from pagedserve.actors.spec_decode.config import SpeculativeConfig
from pagedserve.actors.stats import FinishedRequest, RequestUpdate, StepStats
from pagedserve.gpu.sample.sampler import TokenLogprobs
from pagedserve.gpu.sample.sampling_params import SamplingParams, StructuredOutputsParams
from tests.conftest import engine_config


def roundtrip(msg):
    out = m.decode(m.encode(msg))
    assert type(out) is type(msg) and out == msg
    return out


def test_every_message_comes_back_equal():
    params = SamplingParams(temperature=0.0, max_tokens=7, logit_bias={5: -1.5}, stop=["\n"],
                            structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    out = roundtrip(m.AddRequestMsg(3, "req-1", [1, 2, 3], params, 2, "salt", True))
    assert out.params.logit_bias == {5: -1.5} and out.params.structured_outputs.choice == ["a", "b"]
    delta = GenerationDelta("hi", [7, 8], "stop", 3, 2, [TokenLogprobs(-0.5, 1, [7], [-0.5]),
                                                         TokenLogprobs(-0.1, 1, [8], [-0.1])])
    roundtrip(m.OutputsMsg([m.StreamItem(3, delta, done=True),
                            m.StreamItem(4, error=m.WireError("EngineError", "boom"), done=True)]))
    roundtrip(m.StreamItem(5, beam=BeamSearchOutput([BeamHypothesis([1, 2], -0.3, -0.15, True)],
                                                     ["stop"])))
    roundtrip(m.StatsMsg([StepStats(1.0, 2, 10, 1, 2, 0.01, [0.002])],
                         [RequestUpdate(finish_reason="stop", e2e_s=0.5,
                                        finished=FinishedRequest(3, 4, 16))]))
    roundtrip(m.KVEventsMsg(KVEventBatch(1, [BlockStored([b"\x00\x01", b"\xff"]),
                                             EngineLoad(2, 0)])))
    roundtrip(m.CallMsg(9, "drain", [5.0]))
    config = engine_config("/models/x", speculative=SpeculativeConfig("ngram"))
    assert roundtrip(m.CoreSpec(config, 1, "tcp://127.0.0.1:5", "debug")).config == config


def test_errors_cross_as_the_class_the_http_layer_maps():
    for error in (EngineOverloaded("full"), DuplicateRequestId("dup"), ValueError("bad")):
        with pytest.raises(type(error), match=str(error)):
            m.raise_wire_error(m.wire_error(error))
    with pytest.raises(EngineError, match="^KeyError: 'x'$"):  # anything else is an EngineError
        m.raise_wire_error(m.wire_error(KeyError("x")))


def test_only_allow_listed_types_are_built():
    with pytest.raises(TypeError, match="cannot cross"):
        m.encode(m.CallMsg(1, "get_stats", [object()]))
    forged = msgpack.packb([msgpack.ExtType(1, b""), "Popen", ["sh"]])
    with pytest.raises(KeyError):
        m.decode(forged)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"data_parallel_size": 0}, "--data-parallel-size 0"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "--data-parallel-size-local 3"),
    ({"data_parallel_size": 4, "data_parallel_size_local": 2, "data_parallel_start_rank": 3,
      "headless": True}, "--data-parallel-start-rank 3"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 1, "data_parallel_start_rank": 1},
     "for --headless nodes"),
    ({"data_parallel_size": 2, "data_parallel_size_local": 0, "headless": True},
     "--headless with no local engine"),
])
def test_layouts_that_cannot_be_served_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataParallelConfig(**kwargs).check()


def test_a_headless_node_runs_its_ranks():
    dp = DataParallelConfig(4, 2, data_parallel_start_rank=2, headless=True)
    dp.check()
    assert list(dp.local_ranks) == [2, 3] and dp.in_processes
    assert not DataParallelConfig().in_processes  # dp=1: the engine stays in the process
