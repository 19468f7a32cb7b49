"""The one program inside a fresh sandbox: lowers its own rlimits, then runs the snippet.

argv: the five rlimits (CPU seconds, address space, processes, file size, open files), the snippet's
file name in the working directory. Run as ``python -I -B -X utf8 -c SOURCE`` (``sandboxed.source``).

The snippet runs in the same interpreter as ``python -I -B -X utf8 snippet.py`` would: a fresh
``__main__`` module with a script's globals, ``sys.argv == ["snippet.py"]``, CPython's own handling of
exceptions, SystemExit and exit codes, and tracebacks without this program's frame. That frame stays
below the snippet's for ``inspect.stack()`` and the recursion limit, and a NUL byte in the source is an
error (3.11's file reader ignored the rest of that line). One interpreter per call, where a shim used
to exec a second one: 25% less CPU per call (bench/sandbox.py). ``site`` runs before the rlimits, host
code as in any interpreter (snippets keep ``exit()`` and the system's site-packages); the snippet runs
after them. Not a ``preexec_fn``: no Python may run between fork and exec in a threaded service (a lock
held by another thread at fork time deadlocks the child). Set inside bwrap's user namespace,
RLIMIT_NPROC also counts this sandbox's processes only, not those of concurrent calls.

Module-level code throughout, no function around it: a frame of this program's would sit between the
interpreter and the snippet. The zygote (``zygote.py``) runs this text after its own in each call's
process.
"""

import builtins
import posix
import resource
import sys
from _frozen_importlib_external import SourceFileLoader

cpu, address_space, processes, file_bytes, open_files = map(int, sys.argv[1:6])
for limit, soft, hard in (
    (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
    (resource.RLIMIT_AS, address_space, address_space),
    (resource.RLIMIT_NPROC, processes, processes),
    (resource.RLIMIT_FSIZE, file_bytes, file_bytes),
    (resource.RLIMIT_NOFILE, open_files, open_files),
    (resource.RLIMIT_CORE, 0, 0),
):
    resource.setrlimit(limit, (soft, hard))


def excepthook(kind, error, traceback, shown=sys.excepthook, runner=sys._getframe().f_code):
    while traceback is not None and traceback.tb_frame.f_code is runner:
        traceback = traceback.tb_next
    if isinstance(error, BaseException):  # printed from error.__traceback__, not from the argument
        error.__traceback__ = traceback
    shown(kind, error, traceback)


name = sys.argv[6]
path = posix.getcwd() + "/" + name
main = type(sys)("__main__")
main.__dict__.update(__loader__=SourceFileLoader("__main__", path), __spec__=None, __annotations__={},
                     __builtins__=builtins, __file__=path, __cached__=None)
sys.argv[:] = [name]
sys.modules["__main__"] = main
sys.excepthook = excepthook
with open(name, "rb") as source:
    code = compile(source.read(), path, "exec", dont_inherit=True)
exec(code, main.__dict__)

# The snippet ran to its end: the interpreter's own exit, in its order (non-daemon threads joined,
# atexit, __main__'s objects finalized, the standard streams flushed), then _exit without tearing
# down every object of every module. That teardown writes to the refcount of each object, so in a
# zygote's call it copies most of the interpreter's pages (half of a call's CPU). Files still open are
# flushed before __main__'s objects go: a collection finalizes a cycle's objects in no set order, and
# a file's raw stream closed before its buffer loses what was written (the interpreter's exit, which
# collects later, happens to keep it). Anything that raises (a stream that fails to flush) leaves the
# rest to the interpreter's own exit, which reports it as it would (exit status 120).
try:
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    import atexit  # noqa: E402  (after the snippet: not in sys.modules before, as in a plain script)
    import gc  # noqa: E402
    import io  # noqa: E402

    atexit._run_exitfuncs()  # each callback once: the interpreter's exit finds none left
    for stream in gc.get_objects():  # in a zygote's call, the call's own objects alone (gc.freeze)
        if type(stream) in (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom) and not stream.closed:
            stream.flush()
    stream = None
    main.__dict__.clear()
    gc.collect()  # cycles of __main__'s objects, as the interpreter's exit collects them (__del__)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None and not getattr(stream, "closed", True):
            stream.flush()
except Exception:
    pass
else:
    posix._exit(0)
