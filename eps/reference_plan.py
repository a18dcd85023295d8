"""A reference-EP partition run as a plan: the evaluator's kernels called one after another with what
`ReferenceEvaluator.run` would pass them, without its per-run bookkeeping.

On a small partition that bookkeeping is most of the run, and a worker running partition after partition pays it
several times over with cold caches. The checks the wrappers make around `_run` are kept: the results' types
(`_check_and_fix_outputs`) and, for the unary and binary arithmetic bases, matching dtypes, with the evaluator's
exception types. A node the plan cannot call this way (a subgraph, a function, a linked attribute, a context)
leaves the whole partition to the evaluator.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Any, Callable, Mapping

from numpy import ndarray
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpFunction, OpRun, RuntimeTypeError
from onnx.reference.ops._op import OpRunBinary, OpRunBinaryNum, OpRunUnary, OpRunUnaryNum


def _same_input_dtypes(node: OpRun, args: tuple) -> None:
    x, y = args
    if x is None or y is None:
        raise RuntimeError(f"x and y have different dtype: {type(x)} != {type(y)} ({type(node)})")
    if x.dtype != y.dtype:
        raise RuntimeTypeError(f"Input type mismatch: {x.dtype} != {y.dtype} (operator {type(node).__name__!r}, "
                               f"shapes {x.shape}, {y.shape}).")


def _output_dtype_of_first_input(node: OpRun, args: tuple, res: tuple) -> None:
    if res and res[0] is not None and not isinstance(res[0], list) and res[0].dtype != args[0].dtype:
        raise RuntimeTypeError(f"Output type mismatch: input '{args[0].dtype}' != output '{res[0].dtype}' "
                               f"(operator {type(node).__name__!r}).")


Before = Callable[[OpRun, tuple], None] | None  # checks of the inputs, before `_run`
After = Callable[[OpRun, tuple, tuple], None] | None  # checks of the results (beside their types), after it

# A kernel class's `run` (the wrapper onnx calls `_run` through) -> the checks it makes besides the results'
# types. A class with any other `run` has it called as the evaluator does.
WRAPPERS: dict[Callable, tuple[Before, After]] = {
    OpRun.run: (None, None),
    OpRunUnary.run: (None, None),
    OpRunUnaryNum.run: (None, _output_dtype_of_first_input),
    OpRunBinary.run: (_same_input_dtypes, None),
    OpRunBinaryNum.run: (_same_input_dtypes, _output_dtype_of_first_input),
}


class Step:
    """One node: its kernel, where its inputs come from and where its outputs go."""

    __slots__ = ("node", "inputs", "outputs", "attributes", "direct", "before", "after", "args")

    def __init__(self, node: OpRun):
        self.node = node
        self.inputs = tuple(node.input)
        self.outputs = tuple(node.output)
        # The inputs' values, as a tuple, out of the values made so far (a generator into tuple() costs more).
        self.args = itemgetter(*self.inputs) if len(self.inputs) > 1 else \
            (lambda values, name=self.inputs[0]: (values[name],)) if self.inputs else (lambda values: ())
        checks = WRAPPERS.get(type(node).run)
        self.direct = checks is not None
        self.before, self.after = checks or (None, None)
        # What OpRun.run passes `_run` beside the inputs (fixed for a node without linked attributes); the unary
        # and binary wrappers pass nothing (their kernels read their attributes themselves).
        self.attributes = {a: getattr(node, a) for a in node.attributes_names_} if type(node).run is OpRun.run \
            else {}

    def run(self, args: tuple) -> tuple:
        node = self.node
        if not self.direct:
            return node.run(*args)
        if self.before is not None:
            self.before(node, args)
        try:
            res = node._run(*args, **self.attributes)
        except (TypeError, AttributeError) as e:
            raise TypeError(f"Issues with types {[type(a) for a in args]} (operator {type(node).__name__!r}).") \
                from e
        if type(res) is not tuple or not res or not _arrays(res):  # arrays pass as they are
            res = node._check_and_fix_outputs(res)
        if self.after is not None:
            self.after(node, args, res)
        return res


def _arrays(res: tuple) -> bool:
    for r in res:  # a loop: all() over a generator costs more than the check on one result
        if type(r) is not ndarray:
            return False
    return True


def _callable(node: OpRun) -> bool:
    """Whether a plan can call this node as the evaluator would, without a context or attributes of a caller."""
    return not (node.need_context() or node.has_linked_attribute or node.has_subgraph
                or isinstance(node, OpFunction))


class Plan:
    """The evaluator's nodes in its order, each run with its inputs from the values made so far."""

    def __init__(self, evaluator: ReferenceEvaluator):
        self._initializers = dict(evaluator.rt_inits_)
        self._steps = [Step(n) for n in evaluator.rt_nodes_]
        self._outputs = tuple(evaluator.output_names)

    @classmethod
    def of(cls, evaluator: ReferenceEvaluator) -> "Plan | None":
        """The plan of an evaluator's graph, or None where a node needs the evaluator."""
        if not all(_callable(n) for n in evaluator.rt_nodes_):
            return None
        return cls(evaluator)

    def run(self, feeds: Mapping[str, Any]) -> list[Any]:
        values = {"": None, **self._initializers, **feeds}  # "": an optional input left out
        for step in self._steps:
            values.update(zip(step.outputs, step.run(step.args(values))))
        return [values[name] for name in self._outputs]
