"""Feeds and outputs as ONNX Runtime's own tests use them: onnxruntime.OrtValue feeds and bindings, numpy bytes
and void arrays for strings, ORT's type strings and missing-input message, graph inputs given back as copies."""
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import ephost
from ephost import InferenceSession
import models
from helpers import options_for

STRINGS = models.model([helper.make_node("Identity", ["s"], ["t"])], [models.tensor("s", [2, 2], TensorProto.STRING)],
                       [models.tensor("t", [2, 2], TensorProto.STRING)])


def test_type_strings_are_ort_spellings(env):
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.INT64, None))
    model = models.model([helper.make_node("SequenceLength", ["x"], ["n"]), helper.make_node("Identity", ["o"], ["p"])],
                         [helper.make_value_info("x", seq), helper.make_value_info("o", opt)],
                         [models.tensor("n", [], TensorProto.INT64), helper.make_value_info("p", opt)],
                         opset=[helper.make_opsetid("", 18)])
    with InferenceSession(model, env=env, providers=[]) as session:
        assert [i.type for i in session.get_inputs()] == ["seq(tensor(float))", "optional(tensor(int64))"]
        assert [o.type for o in session.get_outputs()] == ["tensor(int64)", "optional(tensor(int64))"]
        n, p = session.run(None, {"x": [np.ones(2, np.float32)] * 3, "o": np.array(5, np.int64)})
        assert n == 3 and p == 5


def test_missing_inputs_say_so_in_ort_words(env):
    model = models.model([helper.make_node("Add", ["a", "b"], ["c"])],
                         [models.tensor("a", [2]), models.tensor("b", [2])], [models.tensor("c", [2])])
    with InferenceSession(model, env=env, providers=["ref"]) as session:
        with pytest.raises(ValueError, match=r"Required inputs \(\['a'\]\) are missing from input feed \(\['b'\]\)"):
            session.run(None, {"b": np.ones(2, np.float32)})


@pytest.mark.parametrize("fed", [np.array([b"this", b"is", b"identity", b"test"]).reshape(2, 2),
                                 np.array([b"must", b"have", b"same", b"size"], dtype=np.void).reshape(2, 2)],
                         ids=["bytes", "void"])
def test_bytes_and_void_arrays_feed_strings_as_ort_decodes_them(env, fed):
    with InferenceSession(STRINGS, env=env, providers=["ref"]) as session:
        (out,) = session.run(None, {"s": fed})
    assert out.dtype == object and out.tolist() == [[bytes(v).decode() for v in row] for row in fed]


def test_bytes_that_are_not_utf8_are_refused_naming_why(env):
    with InferenceSession(STRINGS, env=env, providers=["ref"]) as session:
        with pytest.raises(ephost.EpInvalidArgument, match="not UTF-8"):
            session.run(None, {"s": np.array([[b"\xff", b"a"], [b"b", b"c"]])})


def test_an_ort_value_is_a_feed_read_where_it_is(env):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    value = ort.OrtValue.ortvalue_from_numpy(x)
    with InferenceSession(models.chain(["Neg"], shape=(2, 3)), env=env, providers=["ref"]) as session:
        (out,) = session.run(None, {"x": value})
        np.testing.assert_array_equal(out, -x)
        (again,) = session.run(None, {"x": value._get_c_value()})  # ORT's C OrtValue too
        np.testing.assert_array_equal(again, -x)
        with pytest.raises(ephost.EpInvalidArgument, match="expects tensor\\(float\\)"):
            session.run(None, {"x": ort.OrtValue.ortvalue_from_numpy(x.astype(np.int32))})


def test_io_binding_takes_ort_values_and_writes_into_the_bound_one(env):
    x = np.array([[1.0, -2.0], [3.0, -4.0]], np.float32)
    with InferenceSession(models.chain(["Relu"], shape=(2, 2)), options_for(env, "ref"), env=env) as session:
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
        out = ort.OrtValue.ortvalue_from_shape_and_type([2, 2], np.float32)
        binding.bind_ortvalue_output("y", out)
        session.run_with_iobinding(binding)
        np.testing.assert_array_equal(out.numpy(), np.maximum(x, 0))  # ORT's OrtValue holds the result
        assert binding.get_outputs()[0].numpy().ctypes.data == out.data_ptr()


def test_a_graph_input_given_back_as_an_output_is_a_copy(env):
    shape = [2, 2]
    model = models.model([helper.make_node("Add", ["x", "ten"], ["plus"])], [models.tensor("x", shape)],
                         [models.tensor("plus", shape), models.tensor("x", shape)],
                         [helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0])])
    kept = []
    with InferenceSession(model, options_for(env, "ref"), env=env) as session:
        for i in range(6):  # beyond the runs after which a worker's calls repeat (client/steady.py)
            x = np.full(shape, float(i), np.float32)
            plus, same = session.run(None, {"x": x})
            assert same is not x and not np.shares_memory(same, x)
            kept.append((plus, same))
            x[:] = -1  # the caller reuses its array: the outputs it has keep their values
    for i, (plus, same) in enumerate(kept):
        np.testing.assert_array_equal(same, np.full(shape, float(i)))
        np.testing.assert_array_equal(plus, np.full(shape, i + 10.0))
