"""TensorRT decisions that need no GPU: profiles from the manifest, profile selection, buffer
sizes, the refusal of plans built elsewhere, the per-layer precision check, and `doctor`."""

import importlib.util
import json

import pytest

from tests.conftest import run_cli
from trtserve.engine_builder import tensorrt
from trtserve.engine_builder.tensorrt import check_precision, kernel_summary
from trtserve.engine_dir.manifest import IO, Shapes, TensorRT
from trtserve.errors import EngineDirError, InputError
from trtserve.runtime import trt_plan
from trtserve.runtime.trt_plan import buffer_bytes, buffer_plan, select_profile

DECODER = {
    "model": {"kind": "decoder"},
    "shapes": {"batch": {"min": 1, "opt": 1, "max": 8}, "sequence": {"min": 1, "opt": 128, "max": 2048},
               "past_sequence": {"min": 0, "opt": 128, "max": 2047},
               "total_sequence": {"min": 1, "opt": 128, "max": 2048},
               "logit_positions": {"min": 1, "opt": 1, "max": 2048}},
    "io": {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]},
                      {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "total_sequence"]},
                      {"name": "logit_positions", "dtype": "int64", "shape": ["logit_positions"]},
                      {"name": "past_key_values.0.key", "dtype": "float32",
                       "shape": ["batch", 3, "past_sequence", 64]}],
           "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "logit_positions", 49152]},
                       {"name": "present.0.key", "dtype": "float32", "shape": ["batch", 3, "total_sequence", 64]}]},
}
ENTRY = {"flavour": "tensorrt", "version": "11.0.0", "compute_capability": "sm90", "version_compatible": False}


def profiles_for(manifest: dict):
    return tensorrt.profiles_for(manifest["model"]["kind"], Shapes.model_validate(manifest["shapes"]),
                                 IO.model_validate(manifest["io"]))


def refuse_reason(entry: dict, *args):
    return trt_plan.refuse_reason(TensorRT(plan="model.plan", profiles=[], io={}, **entry), *args)


def check_loadable(entry: dict, *args):
    return trt_plan.check_loadable(TensorRT(plan="model.plan", profiles=[], io={}, **entry), *args)
H200 = [{"index": 0, "name": "NVIDIA H200", "compute_capability": "9.0"}]


def test_decoder_profiles_cover_prefill_decode_and_prompt_logprobs():
    prefill, decode, scored = profiles_for(DECODER)
    assert (prefill.name, decode.name, scored.name) == ("prefill", "decode", "prompt_logprobs")
    assert prefill.inputs["logit_positions"]["max"] == decode.inputs["logit_positions"]["max"] == [1]
    assert scored.inputs["logit_positions"]["max"] == [2048] and scored.inputs["input_ids"]["max"] == [4, 2048]
    assert prefill.inputs["input_ids"] == {"min": [1, 1], "opt": [1, 128], "max": [8, 2048]}
    assert prefill.inputs["past_key_values.0.key"]["opt"] == [1, 3, 0, 64]  # fixed axes stay as they are
    assert decode.inputs["input_ids"] == {"min": [1, 1], "opt": [1, 1], "max": [8, 1]}
    assert decode.inputs["attention_mask"]["opt"] == [1, 129]


def test_profile_selection():
    profiles = profiles_for(DECODER)
    assert select_profile(profiles, {"batch": 2, "sequence": 300, "past_sequence": 0, "total_sequence": 300}) == 0
    every = {"batch": 1, "sequence": 300, "past_sequence": 0, "total_sequence": 300, "logit_positions": 300}
    assert select_profile(profiles, every) == 2  # the prompt's logprobs: every position's logits
    assert select_profile(profiles, {"batch": 2, "sequence": 1, "past_sequence": 300, "total_sequence": 301}) == 1
    assert select_profile(profiles, {"batch": 1, "sequence": 1, "past_sequence": 0, "total_sequence": 1}) == 0
    with pytest.raises(InputError, match="no optimization profile"):
        select_profile(profiles, {"batch": 9, "sequence": 1, "past_sequence": 0, "total_sequence": 1})


def test_buffers_hold_the_largest_shape_of_any_profile():
    plan = buffer_plan(IO.model_validate(DECODER["io"]), profiles_for(DECODER))
    assert plan["logits"] == ("float32", 4 * 2048 * 49152)  # not 8 rows x 2048 positions: prefill keeps the last
    assert plan["present.0.key"] == ("float32", 8 * 3 * 2048 * 64)
    assert plan["past_key_values.0.key"] == ("float32", 8 * 3 * 2047 * 64)
    assert buffer_bytes(plan) == sum({"int64": 8, "float32": 4}[d] * n for d, n in plan.values())


@pytest.mark.parametrize(("entry", "flavour", "version", "devices", "message"), [
    (ENTRY, None, None, H200, "TensorRT is not installed"),
    (ENTRY, "tensorrt_rtx", "1.7.1.116", H200, "built with tensorrt, this machine has tensorrt_rtx"),
    (ENTRY, "tensorrt", "11.1.0", H200, "built with tensorrt 11.0.0, this machine has 11.1.0"),
    (ENTRY, "tensorrt", "11.0.0", [], "needs a GPU"),
    ({**ENTRY, "compute_capability": "sm86"}, "tensorrt", "11.0.0", H200, "compute capability 9.0"),
    ({**ENTRY, "flavour": "tensorrt_rtx", "version": "1.7.1.116",
      "compute_capability": "portable (TensorRT-RTX: SM75, ...)"}, "tensorrt_rtx", "1.7.1.116", H200, "9.0"),
])
def test_plans_built_elsewhere_are_refused_with_the_rebuild_command(entry, flavour, version, devices, message):
    with pytest.raises(EngineDirError, match="rebuild it here with `trtserve build-engine m --backend tensorrt`") as e:
        check_loadable(entry, flavour, version, devices, "trtserve build-engine m")
    assert message in str(e.value)


def test_matching_plans_load_and_version_compatible_plans_accept_newer_runtimes():
    assert refuse_reason(ENTRY, "tensorrt", "11.0.0", H200, "x") is None
    newer = {**ENTRY, "version_compatible": True}
    assert refuse_reason(newer, "tensorrt", "11.2.0", H200, "x") is None
    assert refuse_reason(newer, "tensorrt", "10.9.0", H200, "x") is not None
    ampere = {**ENTRY, "compute_capability": "hardware compatibility ampere_plus"}
    assert refuse_reason(ampere, "tensorrt", "11.0.0", H200, "x") is None


def test_precision_check_names_fp16_layers_whose_node_is_fp32():
    layers = [("node_MatMul_1", "MATRIX_MULTIPLY", "HALF"), ("node_Softmax_2", "SOFTMAX", "FLOAT"),
              ("node_Pow_3_0", "ELEMENTWISE", "HALF"), ("ONNXTRT_Broadcast", "SHUFFLE", "HALF")]
    expected = {"node_MatMul_1": "HALF", "node_Softmax_2": "FLOAT", "node_Pow_3": "FLOAT"}
    check = check_precision(layers, expected)
    assert check["matched_to_nodes"] == 3
    assert check["violations"] == ["node_Pow_3_0 (ELEMENTWISE) is HALF; node node_Pow_3 is fp32 in the graph"]
    assert check["float_outputs_by_layer_type"]["MATRIX_MULTIPLY"] == {"HALF": 1}


def test_doctor_lists_every_backend_and_why():
    result = run_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    backends = {b["name"]: b for b in facts["backends"]}
    assert backends["onnxruntime"]["build"] and backends["onnxruntime"]["run"]
    rtx = backends["tensorrt_rtx"]
    if importlib.util.find_spec("tensorrt_rtx") is None:
        assert not rtx["build"] and "pip install tensorrt-rtx-cu13" in rtx["why"]
    else:
        assert rtx["build"] and rtx["version"]
    if not facts["cuda_devices"]:
        assert not rtx["run"] and not backends["tensorrt"]["run"] and facts["no_gpu_reason"]
    text = run_cli("doctor").stdout
    assert "tensorrt_rtx" in text and "onnxruntime" in text


def test_kernel_summary_reads_the_detailed_build_log():
    layers = ("Layers:\n"
              "Name: k0, LayerType: shape_call, Inputs: [], Constants: [], Outputs: [], TacticName: , StreamId: 0\n"
              "Name: k1, LayerType: gemm, Inputs: [ { Name: a, Datatype: Float }], Outputs: [ { Name: b, "
              "Datatype: Half, Format: x }], TacticName: t, StreamId: 0, Metadata: [ONNX Layer: node_MatMul_1]\n"
              "Name: k2, LayerType: kgen, Inputs: [ { Name: b, Datatype: Half }], Outputs: [ { Name: c, "
              "Datatype: Float, Format: x }], TacticName: t, StreamId: 0")
    summary = kernel_summary(["Total Activation Memory: 1024 bytes", layers, "Total Weights Memory: 2048 bytes"])
    assert summary == {"count": 3, "output_dtypes_by_kernel_type": {"shape_call": {"none": 1}, "gemm": {"Half": 1},
                                                                    "kgen": {"Float": 1}},
                       "activation_memory_bytes": 1024, "weights_memory_bytes": 2048}
