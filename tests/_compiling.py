"""A compiler backend for tests: torch.compile's graph capture and autograd split, counted."""

from __future__ import annotations


class CountingBackend:
    """``aot_eager`` (the compiler's graph capture and autograd split, no code generation) counting
    the runs of the compiled forward and backward graphs (a graph compiled for a call without gradients,
    as inside an autograd function, counts as a forward one)."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.calls = {"forward": 0, "backward": 0}

        def counted(kind):
            def compiler(graph, _inputs):
                def run(*args):
                    self.calls[kind] += 1
                    return graph(*args)

                return make_boxed_func(run)

            return compiler

        self.backend = aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward"))
