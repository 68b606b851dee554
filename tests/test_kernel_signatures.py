"""The ctypes boundary matches the C++: every ``extern "C"`` entry point of every kernel source
is declared in Python, with the same number and kinds of arguments and the same return type.

A kernel's signature lives in its C++ definition; the Python side declares ``argtypes`` for
ctypes. An argument added on one side only would pass garbage (or truncate a pointer) without
any error, so this reads each definition from the source and checks the loaded library's
declarations against it.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from prefixcache.engine.attention import cpu_kernels
from prefixcache.engine.kernels import cpu_gemm, cpu_layer_ops

# C parameter type (without const and the name) -> the ctypes type it must be declared as.
C_TO_CTYPES = {
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
}
DEFINITION = re.compile(r"^(int|void|int64_t)\s+(pc_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)


def c_signatures(source: Path) -> dict[str, tuple[str, list[str]]]:
    """``name -> (return type, parameter types)`` of the ``extern "C"`` definitions."""
    text = source.read_text(encoding="utf-8")
    block = text[text.index('extern "C" {') :]
    found = {}
    for ret, name, params in DEFINITION.findall(block):
        kinds = []
        for param in params.split(","):
            words = param.replace("const", " ").split()
            kind = " ".join(words[:-1]).replace(" *", "*")
            kinds.append("pointer" if "*" in param else kind)
        found[name] = (ret, kinds)
    return found


def library_cases() -> list[tuple[str, Path, object]]:
    return [
        ("attention", cpu_kernels.SOURCE, cpu_kernels.load),
        ("row attention", cpu_kernels.ROW_SOURCE, cpu_kernels.load_rows),
        ("gemm", cpu_gemm.SOURCE, lambda: cpu_gemm._library.load()),
        ("layer ops", cpu_layer_ops.SOURCE, lambda: cpu_layer_ops._library.load()),
    ]


@pytest.mark.parametrize(("label", "source", "load"), library_cases(), ids=lambda c: str(c))
def test_every_entry_point_is_declared_as_the_cpp_defines_it(
    label: str, source: Path, load: object
) -> None:
    signatures = c_signatures(source)
    assert signatures, f'no extern "C" definitions found in {source.name}'
    lib = load()  # type: ignore[operator]
    if lib is None:
        pytest.skip(f"the {label} kernel cannot load here: {cpu_kernels.unavailable_reason()}")
    for name, (ret, kinds) in signatures.items():
        fn = getattr(lib, name)
        declared = fn.argtypes
        assert declared is not None, f"{name}: no argtypes declared (ctypes would guess ints)"
        assert len(declared) == len(kinds), (
            f"{name}: C++ takes {len(kinds)}, Python declares {len(declared)}"
        )
        for i, (kind, ctype) in enumerate(zip(kinds, declared, strict=True)):
            expected = ctypes.c_void_p if kind == "pointer" else C_TO_CTYPES[kind]
            assert ctype is expected, f"{name} argument {i}: C++ {kind}, Python {ctype}"
        expected_ret = None if ret == "void" else C_TO_CTYPES[ret]
        assert fn.restype is expected_ret, f"{name}: returns {ret}, declared {fn.restype}"


def test_the_parser_sees_every_definition() -> None:
    """A guard for the test itself: the regex finds each ``pc_`` symbol the sources define."""
    for _, source, _ in library_cases():
        text = source.read_text(encoding="utf-8")
        names = set(re.findall(r"\b(pc_\w+)\(", text[text.index('extern "C" {') :]))
        assert names == set(c_signatures(source)), source.name
