"""The seccomp program's shape; tests/integration/test_sandbox.py checks what it refuses, for real."""

from __future__ import annotations

import errno
import struct

import pytest

from rlfleet.services.environment.seccomp import (ARCHITECTURES, CLONE_NEWUSER, UnsupportedArchitecture,
                                                  no_nested_user_namespaces)


def instructions(program: bytes) -> list[tuple[int, int, int, int]]:
    assert len(program) % 8 == 0  # struct sock_filter: what bwrap's --seccomp reads
    return [struct.unpack("<HBBI", program[offset:offset + 8]) for offset in range(0, len(program), 8)]


def run(program: bytes, arch: int, number: int, first_argument: int = 0) -> int:
    """Interpret the program (its few opcodes) on one system call, as the kernel would."""
    data = {0: number, 4: arch, 16: first_argument & 0xFFFFFFFF}
    accumulator, index = 0, 0
    code = instructions(program)
    while True:
        opcode, if_true, if_false, value = code[index]
        if opcode == 0x20:
            accumulator = data[value]
        elif opcode == 0x06:
            return value
        else:
            taken = {0x15: accumulator == value, 0x35: accumulator >= value, 0x45: bool(accumulator & value)}[opcode]
            index += if_true if taken else if_false
        index += 1


ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS


@pytest.mark.parametrize("machine", sorted(ARCHITECTURES))
def test_the_program_refuses_exactly_the_nested_user_namespace_calls(machine):
    arch = ARCHITECTURES[machine]
    program = no_nested_user_namespaces(machine)
    native = arch.audit_arch

    assert run(program, native, arch.unshare, CLONE_NEWUSER) == EPERM
    assert run(program, native, arch.clone, CLONE_NEWUSER | 17) == EPERM
    assert run(program, native, arch.unshare, 0x20000) == ALLOW  # CLONE_NEWNS alone: the kernel's to refuse
    assert run(program, native, arch.clone, 0x01200011) == ALLOW  # what fork() passes
    assert run(program, native, arch.setns) == EPERM
    assert run(program, native, arch.clone3) == ENOSYS
    assert run(program, native, 0) == ALLOW
    assert run(program, 0x40000003, arch.unshare) == EPERM  # another ABI (i386)
    if arch.foreign_numbers_from is not None:
        assert run(program, native, arch.foreign_numbers_from + arch.unshare, CLONE_NEWUSER) == EPERM  # x32


def test_an_unknown_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedArchitecture, match="'riscv64'"):
        no_nested_user_namespaces("riscv64")
