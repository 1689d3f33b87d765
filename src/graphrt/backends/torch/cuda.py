"""``cuda``: CUDA Graphs (``torch.cuda.CUDAGraph``) over the shared torch graph code.

This adapter supplies the CUDA calls (capture on one side stream, memory as the caching
allocator reserves it, Inductor for ``compile_model``); everything else is
:mod:`graphrt.backends.torch.executor`'s. A failed capture runs its bucket eagerly, with a
warning."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from graphrt.backends.torch.backend import TorchBackend
from graphrt.backends.torch.device_graphs import DeviceGraphAPI

#: The CUDA stream-capture mode of every capture: "thread_local", so only a synchronizing or
#: allocating CUDA call made by the capturing thread breaks the capture. torch's default,
#: "global", also fails such calls made by any other thread while the capture runs: another
#: engine's steps in the same process (their syncs on their tokens) and the capture both fail.
CUDA_CAPTURE_ERROR_MODE = "thread_local"

class CudaGraphAPI(DeviceGraphAPI):
    """``torch.cuda`` graphs behind the device-graph API.

    ``cuda`` is the namespace providing ``CUDAGraph``, ``graph``, ``graph_pool_handle``,
    ``Stream``, ``synchronize``, ``memory_reserved`` and ``mem_get_info``: ``torch.cuda``
    unless a test substitutes a stand-in.
    """

    name = "cuda"
    pin_memory = True
    compile_backend = "inductor"
    graphs_share_memory = True
    asynchronous = True

    def __init__(self, device: torch.device | str = "cuda", cuda: Any = None) -> None:
        self.cuda = torch.cuda if cuda is None else cuda
        self.device = torch.device(device)
        self._stream: Any = None

    def new_graph(self) -> Any:
        return self.cuda.CUDAGraph()

    def new_event(self) -> Any:
        """A ``torch.cuda.Event`` (recorded on the current stream)."""
        return self.cuda.Event()

    def new_pool(self) -> Any:
        """A new pool handle. The first one also makes the capture stream (and primes it, see
        :meth:`_prime`): long before any capture is measured."""
        self._capture_stream()
        return self.cuda.graph_pool_handle()

    def _capture_stream(self) -> Any:
        """The one side stream every graph is captured on, made (and primed) on first use."""
        if self._stream is None:
            self._stream = self.cuda.Stream(device=self.device)
            self._prime(self._stream)
        return self._stream

    @contextlib.contextmanager
    def capture(self, graph: Any, pool: Any) -> Iterator[Any]:
        """``graph.capture_begin`` / ``capture_end`` on one side stream, in
        :data:`CUDA_CAPTURE_ERROR_MODE`: what ``torch.cuda.graph`` does, without its per-graph
        ``empty_cache`` (which only makes the next capture allocate again) and without touching
        anything process-wide, so another engine's thread keeps running its steps meanwhile.

        A capture the forward broke makes ``capture_end`` raise before torch releases the pool
        (torch 2.11): :meth:`_abandon` releases it, and
        :class:`~graphrt.backends.torch.device_graphs.GraphPool` gives later graphs a fresh pool;
        without that every later capture fails with "already recording to mempool_id"."""
        stream = self._capture_stream()
        with self.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=CUDA_CAPTURE_ERROR_MODE)
            try:
                yield graph
            finally:
                try:
                    graph.capture_end()
                except BaseException:
                    self._abandon(graph, pool)
                    raise

    def _prime(self, stream: Any) -> None:
        """Run a few matmuls on the capture stream before its first capture, outside any graph.

        cuBLAS allocates a workspace per (handle, stream) at the stream's first matmul (32 MiB on
        Hopper); inside the first capture it would land in that graph's pool for good (38 MiB
        measured for a 2.4 MiB key, H200). Allocated here it is ordinary memory no sample counts."""
        if self.cuda is not torch.cuda:
            return
        with self.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                a = torch.ones(16, 16, dtype=dtype, device=self.device)
                torch.mm(a, a)
                torch.addmm(a[0], a, a)           # the cuBLASLt path (a bias epilogue)
        stream.synchronize()

    def _abandon(self, graph: Any, pool: Any) -> None:
        """Undo what a failed ``capture_end`` left behind: the allocator still routing the capture
        stream's allocations into ``pool`` (the stream itself is restored by :meth:`capture`)."""
        end_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_pool is not None and self.cuda is torch.cuda:
            with contextlib.suppress(RuntimeError):  # raises when torch already released it
                end_pool(self.device.index if self.device.index is not None else self.cuda.current_device(),
                         pool)
        with contextlib.suppress(RuntimeError):
            graph.reset()

    def synchronize(self) -> None:
        self.cuda.synchronize(self.device)

    def memory_in_use(self) -> int:
        """Bytes the caching allocator holds, graph pools included (what a capture adds)."""
        return int(self.cuda.memory_reserved(self.device))

    def memory_info(self) -> tuple[int, int] | None:
        free, total = self.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def release_memory(self) -> None:
        """``torch.cuda.empty_cache``: reserved blocks of dropped graph pools go back to the device."""
        self.synchronize()
        self.cuda.empty_cache()


class CudaGraphBackend(TorchBackend):
    """Torch on an NVIDIA GPU with CUDA Graphs."""

    name = "cuda"
    device_type = "cuda"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.cuda is None:
            return (f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA "
                    "build of torch")
        if not torch.cuda.is_available():
            return ("torch cannot see a CUDA GPU (torch.cuda.is_available() is False: no device, "
                    "no driver, or CUDA_VISIBLE_DEVICES hides them)")
        return None

    def graph_api(self) -> CudaGraphAPI:
        return CudaGraphAPI(self.device)
