"""Helpers shared by the bench scripts (run as ``python bench/<name>.py``, so this imports as ``_common``).

``python bench/_common.py sink MAX_BYTES`` runs the raw byte sink server (``Sink`` starts it).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc
import psutil

SINK_METHOD = "/rlfleet.bench.Sink/Push"


def summarize(base: list[float], measured: list[float]) -> dict:
    """Median of each side and of the per-round ratios measured / base, with the ratios' quartiles."""
    ratios = sorted(m / b for b, m in zip(base, measured))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return dict(base=statistics.median(base), measured=statistics.median(measured),
                ratio=statistics.median(ratios), low=quartiles[0], high=quartiles[2], ratios=ratios)


class CpuMeter:
    """CPU seconds (user + system) of named groups of processes; "bench" is this process.

    A group added with ``follow`` is the process tree under a pid as it is at each snapshot, reaped
    descendants included (their times are added to their parent's ``children_*`` when waited for: a
    sandbox's processes count in the environment service's). With ``host=True`` a snapshot also has
    "host": the busy CPU seconds of the whole machine (``/proc/stat``: what the kernel does for the
    processes too, e.g. namespace teardown in kernel threads, and whatever else runs)."""

    def __init__(self, trees: dict[str, list[psutil.Process]] | None = None, host: bool = False):
        self.trees: dict[str, list[psutil.Process]] = trees if trees is not None else {"bench": [psutil.Process()]}
        self.followed: dict[str, int] = {}
        self.with_host = host

    def add(self, key: str, pid: int) -> None:
        """Count the process ``pid`` and all its descendants (those alive now) under ``key``."""
        root = psutil.Process(pid)
        self.trees[key] = [root, *root.children(recursive=True)]

    def follow(self, key: str, pid: int) -> None:
        """Count the process tree under ``pid`` as it is at each snapshot, reaped descendants included."""
        self.followed[key] = pid

    def snapshot(self) -> dict[str, float]:
        out = {key: self.seconds(procs) for key, procs in self.trees.items()}
        for key, pid in self.followed.items():
            try:
                root = psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                procs = []
            out[key] = self.seconds(procs, reaped=True)
        if self.with_host:
            out["host"] = self.host()
        return out

    @staticmethod
    def seconds(procs: list[psutil.Process], reaped: bool = False) -> float:
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
                if reaped:
                    total += times.children_user + times.children_system
            except psutil.NoSuchProcess:
                pass
        return total

    @staticmethod
    def host() -> float:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {key: after[key] - before.get(key, 0.0) for key in after}


def scrape(port: int, name: str) -> dict[tuple, float]:
    """The samples named ``name`` at ``http://127.0.0.1:PORT/metrics``: {label values sorted by label: value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name}


# ---------------------------------------------------------------- raw gRPC byte sink (the floor of a gRPC push)

def sink_server(max_bytes: int) -> None:
    """A grpc.aio server with one client-streaming method that counts raw bytes (no protobuf)."""

    async def push(request_iterator, context):
        received = 0
        async for chunk in request_iterator:
            received += len(chunk)
        return received.to_bytes(8, "little")

    async def serve():
        handler = grpc.method_handlers_generic_handler(
            "rlfleet.bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_bytes),
                                          ("grpc.max_send_message_length", max_bytes)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


class Sink:
    """The sink server in a child process (``python bench/_common.py sink MAX_BYTES``); ``address`` once up."""

    def __init__(self, max_bytes: int):
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "sink", str(max_bytes)],
                                        stdout=subprocess.PIPE, text=True)
        self.address = f"127.0.0.1:{int(self.process.stdout.readline())}"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def raw_stream_seconds(address: str, flat, chunk_bytes: int, options) -> float:
    """Seconds to stream ``flat`` (a uint8 torch tensor) to the sink as raw ``chunk_bytes`` messages."""
    view = memoryview(flat.numpy())

    def chunks():
        for start in range(0, len(view), chunk_bytes):
            yield bytes(view[start:start + chunk_bytes])  # one copy per chunk, as a push makes

    with grpc.insecure_channel(address, options=options) as channel:
        push = channel.stream_unary(SINK_METHOD)  # no serializers: raw bytes both ways
        started = time.perf_counter()
        received = int.from_bytes(push(chunks(), timeout=600), "little")
        seconds = time.perf_counter() - started
    if received != len(view):
        raise RuntimeError(f"sink received {received} bytes of {len(view)}")
    return seconds


class Link:
    """A TCP proxy on loopback that carries the bytes sent to ``upstream`` at ``bytes_per_second`` at most
    (every connection through it together: one link), the answers at once: a replica behind a network
    link slower than this host's CPU. Runs in the running event loop; ``address`` once ``start`` returned."""

    READ_BYTES = 64 << 10
    BURST_SECONDS = 0.01

    def __init__(self, upstream: str, bytes_per_second: float):
        self.upstream, self.rate = upstream, bytes_per_second
        self.address = ""
        self._server: asyncio.base_events.Server | None = None
        self._free_at = 0.0
        """When the link has sent every byte given to it so far (the event loop's clock)."""
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> "Link":
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        task = asyncio.ensure_future(asyncio.gather(self._pump(reader, up_writer, throttled=True),
                                                    self._pump(up_reader, writer, throttled=False)))
        self._tasks.add(task)
        try:
            await asyncio.wait({task})  # cancelled by ``close``: not an error of the connection's
        finally:
            self._tasks.discard(task)
            writer.close()
            up_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, throttled: bool) -> None:
        """One direction until its end (passed on as such: the other may still answer)."""
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(self.READ_BYTES):
                if throttled:  # the bytes leave once the link carried every byte before them (a sleep that
                    # overshot is made up for, up to BURST_SECONDS: the link's own time is what counts)
                    self._free_at = max(self._free_at, loop.time() - self.BURST_SECONDS) + len(data) / self.rate
                    await asyncio.sleep(self._free_at - loop.time())
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            writer.close()


if __name__ == "__main__" and sys.argv[1:2] == ["sink"]:
    sink_server(int(sys.argv[2]))
