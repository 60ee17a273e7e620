"""Candidates applied to a user's model.yaml: validated by the model's own config class."""

from __future__ import annotations

import copy

import pytest
import yaml

from servewell.config.model import ModelConfig
from servewell.perf.tune_config import ConfigEditError, apply, baseline_candidate, configured_dtype, yaml_block
from servewell.perf.tuner import Candidate

DIGITS = {
    "name": "digits", "runtime": "onnx", "artifact": "model.onnx",
    "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 8, 8]}],
    "outputs": [{"name": "logits", "datatype": "FP32", "shape": [10]}],
    "max_batch_size": 64, "threads": 1,
    "batching": {"max_queue_size": 100, "default_timeout_ms": 5000},
}


def test_the_baseline_is_the_users_own_settings():
    baseline = baseline_candidate(ModelConfig.model_validate(DIGITS))
    assert (baseline.max_batch_size, baseline.policy, baseline.instances, baseline.threads) == (64, "idle", 1, 1)
    assert baseline.dtype is None  # onnx: no serving dtype to change


def test_the_block_pasted_into_the_users_file_gives_a_valid_config_with_the_candidate():
    candidate = Candidate(16, "window", 5.0, 2, 1)
    block = yaml_block(DIGITS, candidate, slo_ms=50.0)
    merged = {**copy.deepcopy(DIGITS), **yaml.safe_load(block)}
    config = ModelConfig.model_validate(merged)
    assert (config.max_batch_size, config.instances, config.threads) == (16, 2, 1)
    assert (config.batching.policy, config.batching.max_wait_ms) == ("window", 5.0)
    assert config.batching.max_queue_size == 100  # the user's other batching settings are kept


def test_adaptive_gets_the_slo_as_its_latency_target():
    doc = apply(DIGITS, Candidate(8, "adaptive", 10.0, 1, 2), slo_ms=40.0)
    assert doc["batching"]["latency_slo_ms"] == 40.0 and doc["batching"]["policy"] == "adaptive"


def test_a_server_for_live_changes_starts_with_the_largest_batch_size():
    doc = apply(DIGITS, Candidate(4, "idle", 0, 1, 2), slo_ms=40.0, max_batch_size=64)
    assert doc["max_batch_size"] == 64 and doc["threads"] == 2
    assert DIGITS["max_batch_size"] == 64 and DIGITS["threads"] == 1  # the user's document is not changed


def test_a_candidate_the_model_cannot_take_is_refused_with_the_reason():
    doc = {**DIGITS, "batching": {"reserve_instance_for_high": True}, "instances": 2}
    with pytest.raises(ConfigEditError, match="reserve_instance_for_high"):
        apply(doc, Candidate(8, "idle", 0, 1, 2), slo_ms=50.0)


def test_dtype_goes_where_this_version_of_model_yaml_keeps_it(tmp_path):
    doc = {"name": "m", "runtime": "torchscript", "artifact": "model.pt",
           "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
           "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}]}
    config = ModelConfig.model_validate(doc)
    assert configured_dtype(config) == "fp32"
    tuned = ModelConfig.model_validate(apply(doc, Candidate(8, "idle", 0, 1, 2, "auto"), slo_ms=50.0))
    assert configured_dtype(tuned) == "auto"
