"""Small ONNX models the tests build."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

OPSET = [helper.make_opsetid("", 18)]


def model(nodes, inputs, outputs, initializers=(), opset=OPSET):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=opset)


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
