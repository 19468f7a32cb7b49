"""The seccomp filter bwrap installs over every snippet: no nested user namespace, in any container.

A snippet runs as uid 65534 in the sandbox's own user namespace. A nested user namespace would
give it every capability there (mounts, raw sockets in a fresh netns, the kernel's less-trodden
namespaced paths), so the sandbox forbids one. bwrap's ``--disable-userns`` does that by writing
``/proc/sys/user/max_user_namespaces`` inside the sandbox, which fails in every Docker and
Kubernetes container (``/proc/sys`` is mounted read-only there, whatever seccomp and AppArmor
allow). This filter forbids it by system call instead, which works on any host and in any container
(bwrap sets ``no_new_privs`` itself, which an unprivileged process needs to install a filter):

- ``unshare`` and ``clone`` with ``CLONE_NEWUSER`` in their flags: ``EPERM``;
- ``setns``: ``EPERM`` (joining a namespace is never a snippet's business);
- ``clone3``: ``ENOSYS`` (its flags sit in a struct a filter cannot read; glibc then falls back to
  ``clone``, which is checked, as flatpak's filter relies on);
- a system call of another ABI (i386 through ``int 0x80``, x32): ``EPERM``, so none of the above
  is reached under another number.

Everything else is allowed: the filter adds this one rule to bwrap's namespaces and the rlimits.
The program is classic BPF (``struct sock_filter``), built here with no library: bwrap's
``--seccomp FD`` reads it raw from a file descriptor.
"""

from __future__ import annotations

import errno
import os
import platform
import struct
from dataclasses import dataclass

CLONE_NEWUSER = 0x10000000

# BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h)
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_AT_LEAST = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JUMP_ANY_BIT = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
_ERRNO = 0x00050000  # SECCOMP_RET_ERRNO | errno

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR_OFFSET = 0
_ARCH_OFFSET = 4
_FIRST_ARGUMENT_LOW_WORD = 16  # little-endian: the low 32 bits of args[0], where CLONE_NEWUSER lives


@dataclass(frozen=True)
class Architecture:
    """One ABI's audit number and the numbers of the calls the filter inspects."""

    audit_arch: int
    clone: int
    unshare: int
    setns: int
    clone3: int
    foreign_numbers_from: int | None = None
    """Numbers at or above this belong to another ABI sharing the audit number (x32 on x86_64)."""


ARCHITECTURES = {
    "x86_64": Architecture(0xC000003E, clone=56, unshare=272, setns=308, clone3=435, foreign_numbers_from=0x40000000),
    "aarch64": Architecture(0xC00000B7, clone=220, unshare=97, setns=268, clone3=435),
}


class UnsupportedArchitecture(RuntimeError):
    """No filter is written for this machine's architecture."""


def no_nested_user_namespaces(machine: str | None = None) -> bytes:
    """The filter's program for ``machine`` (this one's by default), as bwrap's ``--seccomp`` reads it."""
    machine = machine or platform.machine()
    arch = ARCHITECTURES.get(machine)
    if arch is None:
        raise UnsupportedArchitecture(
            f"the sandbox's seccomp filter knows {sorted(ARCHITECTURES)}, not this machine's {machine!r}"
        )
    program = _Program()
    program.load(_ARCH_OFFSET)
    program.jump_unless(_JUMP_EQUAL, arch.audit_arch, "deny")
    program.load(_NR_OFFSET)
    if arch.foreign_numbers_from is not None:
        program.jump_if(_JUMP_AT_LEAST, arch.foreign_numbers_from, "deny")
    program.jump_if(_JUMP_EQUAL, arch.clone3, "no such call")
    program.jump_if(_JUMP_EQUAL, arch.setns, "deny")
    program.jump_if(_JUMP_EQUAL, arch.unshare, "check flags")
    program.jump_if(_JUMP_EQUAL, arch.clone, "check flags")
    program.ret(_ALLOW)
    program.label("check flags")
    program.load(_FIRST_ARGUMENT_LOW_WORD)
    program.jump_if(_JUMP_ANY_BIT, CLONE_NEWUSER, "deny")
    program.ret(_ALLOW)
    program.label("deny")
    program.ret(_ERRNO | errno.EPERM)
    program.label("no such call")
    program.ret(_ERRNO | errno.ENOSYS)
    return program.assemble()


def filter_fd(program: bytes) -> int:
    """A pipe's read end holding ``program``, for bwrap's ``--seccomp FD`` (which reads it to EOF);
    the caller closes it once bwrap has started."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, program)  # a few hundred bytes: far below the pipe's buffer
    finally:
        os.close(write_end)
    return read_end


class _Program:
    """A tiny classic-BPF assembler: forward jumps to labels, resolved at ``assemble()``."""

    def __init__(self):
        self.instructions: list[tuple[int, str | None, str | None, int]] = []
        self.labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self.instructions.append((_LOAD_WORD, None, None, offset))

    def jump_if(self, code: int, value: int, target: str) -> None:
        self.instructions.append((code, target, None, value))

    def jump_unless(self, code: int, value: int, target: str) -> None:
        self.instructions.append((code, None, target, value))

    def ret(self, value: int) -> None:
        self.instructions.append((_RETURN, None, None, value))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.instructions)

    def assemble(self) -> bytes:
        encoded = bytearray()
        for index, (code, if_true, if_false, value) in enumerate(self.instructions):
            encoded += struct.pack("<HBBI", code, self._offset(index, if_true), self._offset(index, if_false), value)
        return bytes(encoded)

    def _offset(self, index: int, target: str | None) -> int:
        if target is None:
            return 0  # fall through to the next instruction
        offset = self.labels[target] - index - 1
        if not 0 <= offset <= 255:
            raise ValueError(f"jump to {target!r} out of a BPF jump's reach ({offset})")
        return offset
