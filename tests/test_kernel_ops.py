"""quantkit.kernels.ops: eager calls skip the dispatcher, torch.compile still sees one opaque op."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quantkit.kernels.ops import call, kernel_op


@kernel_op("quantkit_test::scaled_add")
def scaled_add(x: torch.Tensor, y: torch.Tensor | None = None, alpha: float = 1.0) -> torch.Tensor:
    return x * alpha if y is None else x * alpha + y


@scaled_add.register_fake
def _(x, y=None, alpha=1.0):
    return torch.empty_like(x)


class _Recorder(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_call_runs_the_function_without_the_op():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with _Recorder() as direct:
        got = call(scaled_add, x, y, 2.0)
    with _Recorder() as dispatched:
        ref = scaled_add(x, y, alpha=2.0)
    assert not any("quantkit_test" in op for op in direct.ops) and any("mul" in op for op in direct.ops)
    assert "quantkit_test.scaled_add.default" in dispatched.ops
    assert torch.equal(got, x * 2.0 + y) and torch.equal(got, ref)
    assert torch.equal(call(scaled_add, x, alpha=3.0), x * 3.0)  # keyword arguments pass through


def test_compiled_call_is_one_opaque_op_in_one_graph():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x, y: call(scaled_add, x, y, 3.0) + 1.0, backend=backend, fullgraph=True)
    x, y = torch.randn(5, 2), torch.randn(5, 2)
    assert torch.equal(fn(x, y), x * 3.0 + y + 1.0)
    (gm,) = graphs
    targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
    assert "quantkit_test.scaled_add.default" in targets, targets
