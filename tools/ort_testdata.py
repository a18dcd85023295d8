"""The models ONNX Runtime's Python API tests read from testdata/ (onnxruntime_test_python.py and
onnxruntime_test_python_iobinding.py), made with onnx.helper by the names, inputs, outputs and behaviour those tests
expect, for a copy of the tests without ORT's binary test data (an ORT checkout has the real files).

    python tools/ort_testdata.py DIR    # write DIR/*.onnx and DIR/lora/
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def op(version=13):
    return [helper.make_opsetid("", version)]


def write(out: str) -> None:
    """Write every model into `out` (made if missing)."""
    os.makedirs(os.path.join(out, "lora"), exist_ok=True)

    def save(model, name, **kw):
        model.ir_version = min(model.ir_version, 10)
        onnx.checker.check_model(model)
        onnx.save(model, os.path.join(out, name), **kw)

    # mul_1.onnx: Y = X * W, W = [[1,2],[3,4],[5,6]] (an initializer named W: add_initializer overrides it)
    W = numpy_helper.from_array(np.array([[1, 2], [3, 4], [5, 6]], np.float32), "W")
    save(helper.make_model(helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Y"])], "mul_1",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])], [W]), opset_imports=op()), "mul_1.onnx")

    # matmul_1.onnx: Y[3,1] = X[3,2] @ [[1],[2]]; matmul_2.onnx: the same with the batch dimension named "None"
    for name, dim in (("matmul_1.onnx", 3), ("matmul_2.onnx", "None")):
        B = numpy_helper.from_array(np.array([[1], [2]], np.float32), "B")
        save(helper.make_model(helper.make_graph(
            [helper.make_node("MatMul", ["X", "B"], ["Y"])], "matmul",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [dim, 2])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [dim, 1])], [B]), opset_imports=op()), name)

    # identity_string.onnx
    save(helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["input:0"], ["output:0"])], "identity_string",
        [helper.make_tensor_value_info("input:0", TensorProto.STRING, [2, 2])],
        [helper.make_tensor_value_info("output:0", TensorProto.STRING, [2, 2])]), opset_imports=op()),
        "identity_string.onnx")

    # logicaland.onnx: input1:0 first, then input:0
    save(helper.make_model(helper.make_graph(
        [helper.make_node("And", ["input1:0", "input:0"], ["output:0"])], "logicaland",
        [helper.make_tensor_value_info("input1:0", TensorProto.BOOL, [2, 2]),
         helper.make_tensor_value_info("input:0", TensorProto.BOOL, [2, 2])],
        [helper.make_tensor_value_info("output:0", TensorProto.BOOL, [2, 2])]), opset_imports=op()),
        "logicaland.onnx")

    # identity_opt.onnx: Identity over optional(seq(tensor(float)))
    opt_seq = helper.make_optional_type_proto(helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    save(helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])], "identity_opt",
        [helper.make_value_info("input", opt_seq)], [helper.make_value_info("output", opt_seq)]),
        opset_imports=op(16)), "identity_opt.onnx")

    seq_f = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    seq_i = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, None))
    save(helper.make_model(helper.make_graph(
        [helper.make_node("SequenceLength", ["X"], ["Y"])], "sequence_length",
        [helper.make_value_info("X", seq_f)], [helper.make_tensor_value_info("Y", TensorProto.INT64, [])]),
        opset_imports=op()), "sequence_length.onnx")
    save(helper.make_model(helper.make_graph(
        [helper.make_node("SequenceConstruct", ["tensor1", "tensor2"], ["output_sequence"])], "sequence_construct",
        [helper.make_tensor_value_info("tensor1", TensorProto.INT64, [2, 3]),
         helper.make_tensor_value_info("tensor2", TensorProto.INT64, [2, 3])],
        [helper.make_value_info("output_sequence", seq_i)]), opset_imports=op()), "sequence_construct.onnx")
    save(helper.make_model(helper.make_graph(
        [helper.make_node("SequenceInsert", ["input_seq", "tensor"], ["output_sequence"])], "sequence_insert",
        [helper.make_value_info("input_seq", seq_i),
         helper.make_tensor_value_info("tensor", TensorProto.INT64, [2, 3])],
        [helper.make_value_info("output_sequence", seq_i)]), opset_imports=op()), "sequence_insert.onnx")

    # model_with_valid_ort_config_json.onnx: session options in the model's metadata (ORT_LOAD_CONFIG_FROM_MODEL=1)
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Y"])], "with_config",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])], [W]), opset_imports=op())
    helper.set_model_props(m, {"ort_config": json.dumps({"session_options": {
        "inter_op_num_threads": 5, "intra_op_num_threads": 2, "graph_optimization_level": 99, "enable_profiling": 1}})})
    save(m, "model_with_valid_ort_config_json.onnx")

    # abs_free_dimensions.onnx: x[Dim1 (DATA_BATCH), Dim2 (DATA_CHANNEL), 5]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["Dim1", "Dim2", 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["Dim1", "Dim2", 5])
    for v in (x, y):
        v.type.tensor_type.shape.dim[0].denotation = "DATA_BATCH"
        v.type.tensor_type.shape.dim[1].denotation = "DATA_CHANNEL"
    save(helper.make_model(helper.make_graph([helper.make_node("Abs", ["x"], ["y"])], "abs_free", [x], [y]),
                           opset_imports=op()), "abs_free_dimensions.onnx")

    # model_with_external_initializer_come_from_user.onnx: Pad's pads, also a graph input, in an external file nobody
    # has on disk (as ORT's testdata/model_with_external_initializer_come_from_user.py makes it)
    pads = TensorProto()
    pads.name, pads.data_type, pads.dims[:] = "Pads_not_on_disk", TensorProto.INT64, [4]
    pads.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "Pads_not_on_disk.bin"),):
        entry = pads.external_data.add()
        entry.key, entry.value = k, v
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Pad", ["X", "Pads_not_on_disk"], ["Y"], mode="constant")], "test-model",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2]),
         helper.make_tensor_value_info("Pads_not_on_disk", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 4])], [pads]), producer_name="onnx-example")
    onnx.save(m, os.path.join(out, "model_with_external_initializer_come_from_user.onnx"))

    # model_with_orig_ext_data.onnx: Y[2,3] = X[1,1] * W, W an initializer kept in model_with_orig_ext_data.bin that is
    # also a graph input (as ORT's web tests use it: X = [[1]] gives Y[0] = 1)
    w = numpy_helper.from_array(np.arange(1, 7, dtype=np.float32).reshape(2, 3), "W")
    m = helper.make_model(helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Y"])], "orig_ext_data",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])], [w]), opset_imports=op())
    save(m, "model_with_orig_ext_data.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
         location="model_with_orig_ext_data.bin", size_threshold=0)

    # mnist.onnx: a small convolutional net with MNIST's names (Input3 -> Plus214_Output_0), weights over 100 bytes
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 1, 5, 5)).astype(np.float32), "Parameter5"),
             numpy_helper.from_array(rng.standard_normal((8, 1, 1)).astype(np.float32), "Parameter6"),
             numpy_helper.from_array(np.array([1, 8 * 14 * 14], np.int64), "Shape"),
             numpy_helper.from_array(rng.standard_normal((8 * 14 * 14, 10)).astype(np.float32), "Parameter193"),
             numpy_helper.from_array(rng.standard_normal((1, 10)).astype(np.float32), "Parameter194")]
    nodes = [helper.make_node("Conv", ["Input3", "Parameter5"], ["Convolution28_Output_0"], pads=[2, 2, 2, 2]),
             helper.make_node("Add", ["Convolution28_Output_0", "Parameter6"], ["Plus30_Output_0"]),
             helper.make_node("Relu", ["Plus30_Output_0"], ["ReLU32_Output_0"]),
             helper.make_node("MaxPool", ["ReLU32_Output_0"], ["Pooling66_Output_0"], kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("Reshape", ["Pooling66_Output_0", "Shape"], ["Flat"]),
             helper.make_node("MatMul", ["Flat", "Parameter193"], ["Times212_Output_0"]),
             helper.make_node("Add", ["Times212_Output_0", "Parameter194"], ["Plus214_Output_0"])]
    save(helper.make_model(helper.make_graph(
        nodes, "mnist", [helper.make_tensor_value_info("Input3", TensorProto.FLOAT, [1, 1, 28, 28])],
        [helper.make_tensor_value_info("Plus214_Output_0", TensorProto.FLOAT, [1, 10])], inits),
        opset_imports=op()), "mnist.onnx")

    # add_mul_add.onnx: nodes add_0, mul_0, add_1
    save(helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["t0"], name="add_0"),
         helper.make_node("Mul", ["t0", "B"], ["t1"], name="mul_0"),
         helper.make_node("Add", ["t1", "A"], ["C"], name="add_1")], "add_mul_add",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [3])]), opset_imports=op()), "add_mul_add.onnx")

    # lora/two_params_lora_model.onnx and its adapter, as ORT's testdata/lora/two_params_lora_model.py makes them
    lora_a = helper.make_tensor_value_info("lora_param_a", TensorProto.FLOAT, [4, "dim"])
    lora_b = helper.make_tensor_value_info("lora_param_b", TensorProto.FLOAT, ["dim", 4])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input_x", "weight_x"], ["mm_output_x"]),
         helper.make_node("MatMul", ["input_x", "lora_param_a"], ["mm_output_a"]),
         helper.make_node("MatMul", ["mm_output_a", "lora_param_b"], ["mm_output_b"]),
         helper.make_node("Add", ["mm_output_x", "mm_output_b"], ["output"])],
        "two_params_lora_model",
        [helper.make_tensor_value_info("input_x", TensorProto.FLOAT, [4, 4]), lora_a, lora_b],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [4, 4])],
        [numpy_helper.from_array(np.arange(1, 17, dtype=np.float32).reshape(4, 4), "weight_x"),
         helper.make_tensor("lora_param_a", TensorProto.FLOAT, [4, 0], []),
         helper.make_tensor("lora_param_b", TensorProto.FLOAT, [0, 4], [])])
    onnx.save(helper.make_model(graph, opset_imports=op()), os.path.join(out, "lora", "two_params_lora_model.onnx"))
    # The adapter file is ORT's own format: ORT writes it
    import onnxruntime as ort

    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({
        "lora_param_a": ort.OrtValue.ortvalue_from_numpy(np.array([3, 4, 5, 6], np.float32).reshape(4, 1)),
        "lora_param_b": ort.OrtValue.ortvalue_from_numpy(np.array([7, 8, 9, 10], np.float32).reshape(1, 4))})
    adapter.export_adapter(os.path.join(out, "lora", "two_params_lora_model.onnx_adapter"))

if __name__ == "__main__":
    write(sys.argv[1])
