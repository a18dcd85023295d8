"""Small ONNX models the tests build."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 18)]
IR_VERSION = 10  # what every ONNX Runtime release ephost serves reads (1.24 reads up to 13)


def model(nodes, inputs, outputs, initializers=(), opset=OPSET):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=opset, ir_version=IR_VERSION)


def tensor(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def diamond(shape=(2, 3)):
    """x -> Add -> s; s -> Relu -> r; (s, r) -> Mul -> y. With Add and Mul on one EP and Relu on another,
    fusing {Add, Mul} would put Relu on a path between two nodes of one partition: a cycle."""
    nodes = [helper.make_node("Add", ["x", "x"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("Mul", ["s", "r"], ["y"], name="mul")]
    return model(nodes, [tensor("x", list(shape))], [tensor("y", list(shape))])


def diamond_expected(x):
    s = x + x
    return s * np.maximum(s, 0)


def chain(ops, shape=(4,)):
    """x -> op0 -> op1 -> ... -> y, with unary ops (Relu, Neg, Abs, Sigmoid...)."""
    names = ["x"] + [f"v{i}" for i in range(len(ops) - 1)] + ["y"]
    nodes = [helper.make_node(op, [names[i]], [names[i + 1]], name=f"n{i}_{op}") for i, op in enumerate(ops)]
    return model(nodes, [tensor("x", list(shape))], [tensor("y", list(shape))])


def matmul_with_weights(n_in: int, n_out: int, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((n_in, n_out), dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    return model(nodes, [tensor("x", [1, n_in])], [tensor("y", [1, n_out])],
                 [numpy_helper.from_array(w, "w")]), w


def with_if():
    """y = If(cond) then (x2 + w) else (x2 - w), where x2 = Relu(x) is made outside the If and read by the
    branches from the outer scope, as is the initializer w."""
    then_graph = helper.make_graph([helper.make_node("Add", ["x2", "w"], ["t"], name="then_add")], "then", [],
                                   [tensor("t", [3])])
    else_graph = helper.make_graph([helper.make_node("Sub", ["x2", "w"], ["e"], name="else_sub")], "else", [],
                                   [tensor("e", [3])])
    nodes = [helper.make_node("Relu", ["x"], ["x2"], name="relu"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_graph, else_branch=else_graph)]
    w = numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "w")
    return model(nodes, [tensor("x", [3]), tensor("cond", [], TensorProto.BOOL)], [tensor("y", [3])], [w])


def with_loop():
    """Sums x into an accumulator `n` times with a Loop whose body reads x from the outer scope."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "xr"], ["acc_out"], name="body_add"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [tensor("i", [], TensorProto.INT64), tensor("cond_in", [], TensorProto.BOOL), tensor("acc_in", [2])],
        [tensor("cond_out", [], TensorProto.BOOL), tensor("acc_out", [2])])
    nodes = [helper.make_node("Relu", ["x"], ["xr"], name="relu"),
             helper.make_node("Loop", ["n", "true", "zero"], ["sum"], name="loop", body=body)]
    zero = numpy_helper.from_array(np.zeros(2, np.float32), "zero")
    true = numpy_helper.from_array(np.array(True), "true")
    return model(nodes, [tensor("x", [2]), tensor("n", [], TensorProto.INT64)], [tensor("sum", [2])], [zero, true])


# --- models with external data ----------------------------------------------------------------------------

def _external(t: TensorProto, location: str, offset: int, length: int) -> TensorProto:
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def sparse_external_model(folder, weights: int = 5, elements: int = 128 << 20, positions=(0, 12345, 1 << 26),
                          location: str = "weights.bin", opset: int = 18, dense: bool = False, aligned: bool = True,
                          reads_all: bool = False):
    """A model whose `weights` float32 initializers of `elements` each (512 MiB by default: 2.5 GiB in all)
    live in one external file made sparse: only the floats at `positions` of each are written (value
    1000 * k + j + 0.5 for weight k, position j), the rest is a hole that costs no disk (`dense`: ones, written
    out, as a real model's bytes are). The graph reads just those: y = Sum_k Gather(W_k, idx). Returns (model
    path, idx, expected y); the hole the expected y reads is 0 (1 where dense). `aligned`: each weight starts on
    a 64 KiB boundary (ORT maps those); else right after the one before, as onnx.save writes them (ORT reads
    those into its own memory). `reads_all`: a second output, `peak` = the largest float of all weights
    (Max_k ReduceMax(W_k); 1000 * (weights - 1) + len(positions) - 0.5), so that a run reads every weight's bytes
    as a real model's does."""
    import os
    import onnx
    folder = os.fspath(folder)
    nbytes = elements * 4
    stride = -(-nbytes // 65536) * 65536 if aligned else nbytes + 4
    path = os.path.join(folder, location)
    with open(path, "wb") as f:
        f.truncate(stride * weights)
        if dense:
            ones = np.ones(min(elements, 16 << 20), np.float32).tobytes()
            for k in range(weights):
                for start in range(0, elements, len(ones) // 4):
                    os.pwrite(f.fileno(), ones[:4 * min(len(ones) // 4, elements - start)], k * stride + 4 * start)
        for k in range(weights):
            for j, p in enumerate(positions):
                os.pwrite(f.fileno(), np.float32(1000 * k + j + 0.5).tobytes(), k * stride + 4 * p)
    inits = [_external(TensorProto(name=f"W{k}", data_type=TensorProto.FLOAT, dims=[elements]), location,
                       k * stride, nbytes) for k in range(weights)]
    nodes = [helper.make_node("Gather", [f"W{k}", "idx"], [f"g{k}"], name=f"gather{k}") for k in range(weights)]
    nodes.append(helper.make_node("Sum", [f"g{k}" for k in range(weights)], ["y"], name="sum"))
    outputs = [tensor("y", [None])]
    if reads_all:
        nodes += [helper.make_node("ReduceMax", [f"W{k}"], [f"m{k}"], name=f"max{k}", keepdims=0)
                  for k in range(weights)]
        nodes.append(helper.make_node("Max", [f"m{k}" for k in range(weights)], ["peak"], name="peak"))
        outputs.append(tensor("peak", []))
    m = model(nodes, [tensor("idx", [None], TensorProto.INT64)], outputs, inits,
              opset=[helper.make_opsetid("", opset)])
    model_path = os.path.join(folder, "model.onnx")
    onnx.save(m, model_path)
    idx = np.array([*positions, 7], np.int64)  # every position written, and a hole (zeros)
    expected = np.array([sum(1000 * k + j + 0.5 for k in range(weights)) for j in range(len(positions))]
                        + [float(weights) if dense else 0.0], np.float32)
    return model_path, idx, expected
