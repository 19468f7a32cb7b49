"""The init of an episode's sandbox (``EpisodeSandbox``): forks a fresh process for each call.

argv: the five rlimits, the snippet's file name (as ``snippet_runner.py``), the control socket's fd.
Run as ``python -I -B -X utf8 -c SOURCE`` where SOURCE is this program followed by
``snippet_runner.py`` (``sandboxed.source("zygote", "snippet_runner")``): ``serve()`` returns only in a
call's process, which then goes on exactly as a fresh sandbox's runner does (the rlimits, then the
snippet as ``__main__``). The zygote itself never returns from ``serve()``.

A call is one byte on the control socket carrying four fds (the snippet's source, stdin, stdout,
stderr); the answer is ``"<wait status> <1: clean, 0: not> <CPU microseconds>\\n"``, after the reset;
the CPU is the call's: its processes (reaped orphans included) and the zygote's own for the call
(fork, reset). A reset alone (an episode's end, before the sandbox is parked for the next episode) is
the byte ``r`` without fds; the answer is ``"0 <1: clean, 0: not> <CPU microseconds>\\n"``. Ready to
serve, the zygote says so first, unasked, in the same form (``"0 1 <its CPU since it started>"``). Clean:
every other process of the namespace killed and reaped, none left in ``/proc`` (when mounted), the
working directory and ``/tmp`` emptied.
"""

import array
import atexit  # noqa: F401  as resource: the snippet runner's exit imports it
import ctypes
import gc
import os
import resource  # the snippet runner's too: imported once here, not by every call
import signal
import sys

import _socket
from _frozen_importlib_external import SourceFileLoader  # noqa: F401  as resource


def empty(directory):
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if not empty(entry.path):
                        return False
                    os.rmdir(entry.path)
                else:
                    os.unlink(entry.path)
    except (OSError, RecursionError):
        return False
    return True


def cpu_us(usage):
    return int((usage.ru_utime + usage.ru_stime) * 1e6)


def reset(workdir):
    """Kill every process of the namespace but this one, empty the scratch directories; whether clean,
    and the CPU (microseconds) of the orphans reaped."""
    try:
        os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
    except ProcessLookupError:
        pass
    reaped = 0
    while True:  # orphans are this init's children: none left means none alive
        try:
            reaped += cpu_us(os.wait3(0)[2])
        except ChildProcessError:
            break
    if not (empty(workdir) and empty("/tmp")):
        return False, reaped
    try:
        return [name for name in os.listdir("/proc") if name.isdigit()] in ([], ["1"]), reaped
    except OSError:
        return True, reaped  # no /proc mounted: the reaping above is the check


def warm_up(workdir):
    """What every call's process does first, done once here: the state it sets up lazily (the compiler's,
    the signal module's, a module's and a loader's types) is then the zygote's, shared, where each call
    would otherwise write it to pages of its own (a third of a call's CPU was page copies)."""
    compile("import os\n\ndef f(x, *, y=1):\n    return [i * y for i in range(x)]\n\n"
            "try:\n    print(f'{sum(f(10))}', {'k': (1.5, None)})\nexcept ValueError as e:\n    raise\n",
            workdir + "/" + sys.argv[6], "exec", dont_inherit=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    type(sys)("__main__").__dict__.update(__loader__=SourceFileLoader("__main__", workdir + "/" + sys.argv[6]))


def serve():
    if os.getpid() != 1:  # kill(-1) below is for a pid namespace of our own only: never the host's
        os._exit(2)
    libc = ctypes.CDLL(None, use_errno=True)

    def dumpable(flag):
        if libc.prctl(4, flag, 0, 0, 0):  # PR_SET_DUMPABLE
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    dumpable(0)  # no ptrace, no /proc/1/mem or /proc/1/fd for the snippets
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # the namespace's init: a signal without handler never arrives
    control = _socket.socket(fileno=int(sys.argv[7]))
    workdir = os.getcwd()
    warm_up(workdir)
    gc.freeze()  # the zygote's objects stay out of every call's collections: fewer pages copied on write
    control.sendall(b"0 1 %d\n" % cpu_us(resource.getrusage(resource.RUSAGE_SELF)))  # ready
    while True:
        message, ancillary, _, _ = control.recvmsg(1, _socket.CMSG_SPACE(16))
        if not message:
            os._exit(0)  # the host closed the episode's sandbox
        fds = array.array("i")
        for _, _, data in ancillary:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        before = cpu_us(resource.getrusage(resource.RUSAGE_SELF))
        if message == b"r" and not fds:
            clean, _ = reset(workdir)
            control.sendall(b"0 %d %d\n" % (clean, cpu_us(resource.getrusage(resource.RUSAGE_SELF)) - before))
            continue
        if message != b"c" or len(fds) != 4:
            os._exit(3)
        child = os.fork()
        if child == 0:  # the call's process
            control.close()
            os.setsid()
            dumpable(1)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            source, *standard = fds
            for target, fd in enumerate(standard):
                os.dup2(fd, target)
                os.close(fd)
            with open(source, "rb") as code, open(sys.argv[6], "wb") as snippet:
                snippet.write(code.read())
            return
        for fd in fds:
            os.close(fd)
        _, status, usage = os.wait4(child, 0)
        clean, reaped = reset(workdir)
        spent = cpu_us(usage) + reaped + cpu_us(resource.getrusage(resource.RUSAGE_SELF)) - before
        control.sendall(b"%d %d %d\n" % (status, clean, spent))


serve()
