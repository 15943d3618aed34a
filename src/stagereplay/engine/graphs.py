"""Single-token decode steps on a static cache, captured in a CUDA graph and replayed (CUDA only).

At batch 1 a large model's step is bound by the host: thousands of kernel launches, each costing microseconds
of Python and driver time, while the GPU needs a few milliseconds to read the weights. A CUDA graph records the
step's kernels once and replays them with one launch. It records the kernels the eager step launches, on the
same tensors, in the same order, with no fusion: every bit is the eager static step's
(tests/test_cuda_graphs.py, marked `gpu`, compares them step by step).

A graph replays fixed addresses, so it needs a cache whose tensors never move (transformers' StaticLayer writes
its [B, H_kv, L, D] tensors in place and counts positions in a device tensor) and inputs in fixed buffers: the
token (1, 1) and its position (1, 1) are written into the graph's own buffers before each replay, the token by
the device (`Stepper.forward`'s `device_token`: the previous step's pick, never a host round trip). Each cache
gets its own graph, captured on its first single-token step and dropped with it. Not captured: a sliding-window
layer (StaticSlidingWindowLayer keeps its length in a Python int and branches on it), fp32-compute (its hooks
re-cast the weights on every forward), and any step the capture refuses (a host sync inside the model); those
run eagerly, with the same numbers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Step = Callable[["torch.Tensor", "torch.Tensor", Any], "torch.Tensor"]


def graphable(cache: Any) -> bool:
    """Whether a step on `cache` can be replayed: every layer a full-attention static layer on a CUDA device."""
    layers = getattr(cache, "layers", ())
    return bool(layers) and all(
        hasattr(layer, "max_cache_len") and not hasattr(layer, "cumulative_length_int")
        and getattr(layer, "is_initialized", False) and layer.keys.is_cuda
        for layer in layers
    )


class CudaGraphs:
    """The graphs of one Stepper, one per live static cache (a weak map: a graph goes when its cache goes)."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.enabled = True
        self._graphs: weakref.WeakKeyDictionary[Any, _Graph] = weakref.WeakKeyDictionary()

    def forward(self, cache: Any, token: torch.Tensor, past: int) -> torch.Tensor | None:
        """The step's logits [V] at position `past` for `token` (a (1, 1) int64 device tensor), from the cache's
        graph (captured now if this is the cache's first step); None where no graph can run it."""
        if not self.enabled or not graphable(cache):
            return None
        graph = self._graphs.get(cache)
        if graph is None:
            logits, graph = _capture(self.step, cache, token, past)
            if graph is None:  # the capture was refused: this model's steps run eagerly from now on
                self.enabled = False
            else:
                self._graphs[cache] = graph
            return logits
        return graph.replay(token, past)


class _Graph:
    def __init__(self, graph: Any, token: torch.Tensor, position: torch.Tensor, logits: torch.Tensor) -> None:
        self.graph, self.token, self.position, self.logits = graph, token, position, logits

    def replay(self, token: torch.Tensor, past: int) -> torch.Tensor:
        self.token.copy_(token)  # device to device: the pick never visits the host on its way in
        self.position.fill_(past)
        self.graph.replay()
        return self.logits.clone()  # the graph rewrites its output on the next replay; a kept step must not change


def _capture(step: Step, cache: Any, token: torch.Tensor, past: int) -> tuple[torch.Tensor, _Graph | None]:
    """Run this step eagerly on a side stream (it warms up what a capture cannot create: cuBLAS handles and
    workspaces), then record the next one without running it. Returns the eager step's logits and the graph."""
    import torch

    device = token.device
    buf_token = token.clone()
    buf_position = torch.full((1, 1), past, dtype=torch.long, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        logits = step(buf_token, buf_position, cache).clone()  # the real step at `past`: the cache grows by one
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):  # records kernels without running them: the cache is not written
            out = step(buf_token, buf_position, cache)
    except RuntimeError:  # e.g. a host sync inside the model (a dynamic RoPE reading its positions)
        return logits, None
    return logits, _Graph(graph, buf_token, buf_position, out)
