"""Kernel calls recorded once and replayed in one ``ctypes`` call (``cpu_replay.cpp``).

The kernel wrappers (``cpu_layer_ops``, ``cpu_gemm``, ``cpu_qgemm``, the row attention) build
each call as a ``KernelCall``: its prototype, the entry point and the arguments. Called
directly, it runs at once (the eager path); collected into a ``Program`` over buffers that
outlive it, the calls run back to back in C, the same entries with the same arguments, so
the same bits, without the few microseconds of Python and ``ctypes`` each would cost. An
argument that changes from run to run is a ``Reg``: ``Program.run`` fills it from its
registers first.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from . import cpu_library

SOURCE = Path(__file__).with_name("cpu_replay.cpp")

# The prototypes cpu_replay.cpp knows (its Kind), and which of their arguments are floats.
NORM, ROTARY, SILU, GEMM_BF16, GEMM_F32, QGEMM, WRITE_KV, ATTEND, GEMMA_NORMS, GELU = range(10)
FLOAT_ARGS = {NORM: {9}, ROTARY: {15, 16}, ATTEND: {16, 17}, GEMMA_NORMS: {7}}


@dataclass(frozen=True, slots=True)
class Reg:
    """An argument taken from register ``index`` of each ``Program.run``."""

    index: int


Arg = int | float | None | Reg


class KernelCall(NamedTuple):
    """One call of a kernel entry: ``kind`` names its prototype (``FLOAT_ARGS``: which of its
    arguments are floats)."""

    kind: int
    fn: ctypes._CFuncPtr
    args: tuple[Arg, ...]

    def __call__(self) -> int | None:
        return self.fn(*self.args)


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pc_replay_slots.argtypes, lib.pc_replay_slots.restype = [], i64
    lib.pc_replay.argtypes = [ptr, i64, ptr, i64, ptr, ptr]
    lib.pc_replay.restype = i64


_library = cpu_library.CpuLibrary(SOURCE, "CPU call replay", "one call at a time", _declare)


def available() -> bool:
    """Whether the replay library is built and loaded (building it on first use)."""
    return _library.load() is not None


def _word(arg: Arg, kind: int, index: int) -> int:
    """The int64 word of argument ``index``: a float slot as an IEEE single's bits (an int
    there converted first, as ctypes converts it), others as integers (None: 0)."""
    if index in FLOAT_ARGS.get(kind, ()):
        if not isinstance(arg, float | int) or isinstance(arg, bool):
            raise TypeError(f"argument {index} of kind {kind} is a float, not {arg!r}")
        return struct.unpack("<I", struct.pack("<f", float(arg)))[0]
    if arg is None:
        return 0
    if isinstance(arg, bool | int):
        return int(arg)
    raise TypeError(f"argument {index} of kind {kind} is an integer or address, not {arg!r}")


class Program:
    """``calls`` run in order by one ``run(registers)``. ``keep``: tensors the calls point into,
    held for the program's life (what else they point into, such as a model's packed weights,
    must outlive it: ``StepReplay`` holds its model)."""

    __slots__ = ("_calls", "_failed", "_keep", "_n_patches", "_n_rows", "_patches", "kinds")
    __slots__ += ("num_registers",)

    def __init__(self, calls: Sequence[KernelCall], keep: Sequence[torch.Tensor] = ()) -> None:
        lib = _library.load()
        cpu_library.require(lib is not None, "cpu_replay used where available() is false")
        slots = lib.pc_replay_slots()
        rows = torch.zeros(max(len(calls), 1), slots, dtype=torch.int64)
        patches: list[tuple[int, int, int]] = []
        for r, call in enumerate(calls):
            cpu_library.require(len(call.args) <= slots - 2, "at most SLOTS - 2 arguments")
            address = ctypes.cast(call.fn, ctypes.c_void_p).value
            cpu_library.require(address is not None, "a kernel entry point")
            words = [call.kind, address]
            for i, arg in enumerate(call.args):
                if isinstance(arg, Reg):
                    patches.append((r, i, arg.index))
                words.append(0 if isinstance(arg, Reg) else _word(arg, call.kind, i))
            rows[r, : len(words)] = torch.tensor(words, dtype=torch.int64)
        self._calls = rows
        self._n_rows = len(calls)
        self._patches = torch.tensor(patches, dtype=torch.int64).view(-1, 3)
        self._n_patches = len(patches)
        self.num_registers = 1 + max((p[2] for p in patches), default=-1)
        self.kinds = [call.kind for call in calls]
        self._keep = tuple(keep)
        self._failed = ctypes.c_int32(0)

    def __len__(self) -> int:
        return self._n_rows

    def run(self, registers: Sequence[int]) -> None:
        """Every call, in order, its ``Reg`` arguments taken from ``registers``; a clear error
        naming the call whose entry returned nonzero (the later ones do not run)."""
        cpu_library.require(len(registers) >= self.num_registers, "a value for every register")
        values = (ctypes.c_int64 * max(len(registers), 1))(*registers)
        failed = _library.load().pc_replay(  # type: ignore[union-attr]
            self._calls.data_ptr(), self._n_rows, self._patches.data_ptr(), self._n_patches,
            values, ctypes.byref(self._failed),
        )  # fmt: skip
        if failed:
            raise ValueError(
                f"replayed kernel call {failed - 1} (kind {self.kinds[failed - 1]}) "
                f"returned {self._failed.value}"
            )
