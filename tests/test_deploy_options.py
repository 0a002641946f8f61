"""How `serve --ray` maps our limits onto Ray Serve, and the first-start engine rules (no cluster needed)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import run_cli
from trtserve.deploy.engines import engine_for, target_key
from trtserve.deploy.ray_serve import RayOptions, deployment_options, replica_config
from trtserve.errors import TrtServeError
from trtserve.server.config import ServerConfig

CFG = ServerConfig(engine_dir="unused", max_queue=64, max_batch=16, max_num_seqs=8, drain_timeout=12)


def test_queue_limits_become_ray_limits_with_429_backpressure():
    options = deployment_options(CFG, "encoder", RayOptions(replicas=2), gpus=0, cpus=4)
    assert options["num_replicas"] == 2
    assert options["max_ongoing_requests"] == 64 and options["max_queued_requests"] == 64
    assert options["backpressure_config"] == {"status_code": 429, "retry_after_s": 1}
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert options["graceful_shutdown_timeout_s"] == 12


def test_one_replica_per_gpu_by_default():
    options = deployment_options(CFG, "decoder", RayOptions(), gpus=8, cpus=64)
    assert options["num_replicas"] == 8 and options["ray_actor_options"]["num_gpus"] == 1.0
    half = deployment_options(CFG, "decoder", RayOptions(num_gpus_per_replica=2), gpus=8, cpus=64)
    assert half["num_replicas"] == 4
    assert deployment_options(CFG, "encoder", RayOptions(), gpus=0, cpus=16)["num_replicas"] == 1


def test_autoscaling_targets_one_full_batch_per_replica():
    decoder = deployment_options(CFG, "decoder", RayOptions(replicas=0), gpus=4, cpus=32)
    assert "num_replicas" not in decoder
    assert decoder["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    encoder = deployment_options(CFG, "encoder", RayOptions(replicas=0, max_replicas=3), gpus=0, cpus=8)
    assert encoder["autoscaling_config"]["target_ongoing_requests"] == 16
    assert encoder["autoscaling_config"]["max_replicas"] == 3


def test_more_gpus_per_replica_than_the_cluster_has_is_a_clear_error():
    with pytest.raises(TrtServeError, match="the Ray cluster has 0 GPU"):
        deployment_options(CFG, "encoder", RayOptions(num_gpus_per_replica=1), gpus=0, cpus=4)
    with pytest.raises(TrtServeError, match="the Ray cluster has 2 CPU"):
        deployment_options(CFG, "encoder", RayOptions(num_cpus_per_replica=4), gpus=0, cpus=2)


def test_a_replica_is_one_in_process_worker_with_its_cpus_as_threads():
    replica = replica_config(CFG, 3.0)
    assert replica.workers == 0 and replica.threads == 3 and replica.max_queue == 64


def test_engine_key_on_the_cpu_and_an_empty_mount(tmp_path):
    assert target_key("onnxruntime", "onnxruntime") == "onnxruntime"
    if importlib.util.find_spec("openvino") is not None:  # an encoder's build measures OpenVINO on this CPU
        assert target_key("onnxruntime", "auto").startswith("onnxruntime-openvino")
        assert target_key("openvino", "openvino").startswith("openvino") and "-cpu" in target_key("openvino")
    else:
        assert target_key("onnxruntime", "auto") == "onnxruntime"
    with pytest.raises(TrtServeError, match="is an empty directory: mount a checkpoint or an engine directory"):
        engine_for(str(tmp_path))


@pytest.mark.parametrize("flag, value, message", [
    ("--replicas", "-1", "--replicas must not be negative"),
    ("--num-cpus-per-replica", "0", "--num-cpus-per-replica must be positive"),
    ("--threads", "0", "--threads must be positive"),
])
def test_serve_rejects_bad_ray_and_thread_flags(tmp_path, flag, value, message):
    result = run_cli("serve", str(tmp_path), flag, value, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_engine_cache_key_follows_the_checkpoint_content(tmp_path):
    from trtserve.deploy.engines import content_key

    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights v1")
    first = content_key(str(tmp_path))
    assert content_key(str(tmp_path)) == first and len(first) == 12
    (tmp_path / "model.safetensors").write_bytes(b"weights v2")  # same folder name, new weights
    assert content_key(str(tmp_path)) != first


@pytest.mark.parametrize("variable, value, message", [
    ("TRTSERVE_PORT", "abc", "TRTSERVE_PORT='abc' is not an integer"),
    ("TRTSERVE_REQUEST_TIMEOUT", "soon", "TRTSERVE_REQUEST_TIMEOUT='soon' is not a number"),
    ("TRTSERVE_BACKEND", "gpu", "TRTSERVE_BACKEND='gpu' is not one of auto, onnxruntime, tensorrt, openvino"),
    ("TRTSERVE_RAY", "maybe", "TRTSERVE_RAY='maybe' is not true or false"),
])
def test_a_bad_trtserve_variable_is_one_line_for_serve_and_harmless_elsewhere(tmp_path, variable, value, message):
    served = run_cli("serve", str(tmp_path), env={variable: value}, timeout=60)
    assert served.returncode == 2 and served.stderr.strip() == f"error: {message}: fix or unset it", served.stderr
    info = run_cli("info", str(tmp_path), env={variable: value}, timeout=60)
    assert info.returncode == 2 and "Traceback" not in info.stderr and "no manifest.json" in info.stderr
    if variable == "TRTSERVE_PORT":
        check = run_cli("healthcheck", env={variable: value}, timeout=60)
        assert check.returncode == 2 and message in check.stderr and "Traceback" not in check.stderr
