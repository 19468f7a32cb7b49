"""The init of an episode's sandbox (``EpisodeSandbox``): forks a fresh process for each call.

argv: the five rlimits, the snippet's file name (as ``snippet_runner.py``), the control socket's fd.
Run as ``python -I -B -X utf8 -c SOURCE`` where SOURCE is this program followed by
``snippet_runner.py`` (``sandboxed.source("zygote", "snippet_runner")``): ``serve()`` returns only in a
call's process, which then goes on exactly as a fresh sandbox's runner does (the rlimits, then the
snippet as ``__main__``). The zygote itself never returns from ``serve()``.

A call is one byte on the control socket carrying four fds (the snippet's source, stdin, stdout,
stderr); the answer is ``"<wait status> <1: emptied, 0: not>\\n"``.
"""

import array
import ctypes
import gc
import os
import resource  # noqa: F401  the snippet runner's: imported once here, not by every call
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
    gc.freeze()  # the zygote's objects stay out of every call's collections: fewer pages copied on write
    while True:
        message, ancillary, _, _ = control.recvmsg(1, _socket.CMSG_SPACE(16))
        if not message:
            os._exit(0)  # the host closed the episode's sandbox
        fds = array.array("i")
        for _, _, data in ancillary:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if len(fds) != 4:
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
        status = os.waitpid(child, 0)[1]
        try:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
        except ProcessLookupError:
            pass
        while True:  # orphans are this init's children: none left means none alive
            try:
                os.wait()
            except ChildProcessError:
                break
        emptied = empty(workdir) and empty("/tmp")
        control.sendall(b"%d %d\n" % (status, emptied))


serve()
