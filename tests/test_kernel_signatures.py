"""The ctypes boundary matches the C++: every ``extern "C"`` entry point of every kernel source
is declared in Python, with the same number and kinds of arguments and the same return type.

A kernel's signature lives in its C++ definition; the Python side declares ``argtypes`` for
ctypes. An argument added on one side only would pass garbage (or truncate a pointer) without
any error, so this reads each definition from the source and checks the loaded library's
declarations against it. Definitions under ``#ifndef PC_NARROW_VECTORS`` exist in the native
build only: the AVX2 build must leave them out (the Python side asks ``hasattr`` to learn
which dtypes a build computes).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from prefixcache.engine.attention import cpu_kernels, row_kernels
from prefixcache.engine.kernels import cpu_gemm, cpu_layer_ops, cpu_library, cpu_qgemm, cpu_replay

# C parameter type (without const and the name) -> the ctypes type it must be declared as.
C_TO_CTYPES = {
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
}
DEFINITION = re.compile(r"^(int|void|int64_t)\s+(pc_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)


MACRO = re.compile(r"^#define (PC_\w+)\(([^)]*)\)((?:.*\\\n)*.*)$", re.MULTILINE)
NATIVE_BLOCK = re.compile(r"^#ifndef PC_NARROW_VECTORS\b.*?^#endif", re.MULTILINE | re.DOTALL)


def entry_block(source: Path) -> str:
    """The source's ``extern "C"`` block, with its ``PC_`` macros expanded where invoked (one
    macro may define an entry point per dtype)."""
    text = source.read_text(encoding="utf-8")
    block = text[text.index('extern "C" {') :]
    for name, params, body in MACRO.findall(block):
        block = block.replace(MACRO.search(block).group(0), "", 1)
        names = [p.strip() for p in params.split(",")]
        body = "\n".join(line.rstrip(" \\").strip() for line in body.splitlines())

        def expand(call: re.Match[str], names: list[str] = names, body: str = body) -> str:
            out = body
            for param, arg in zip(names, call.group(1).split(","), strict=True):
                out = re.sub(rf"\b{param}\b", arg.strip(), out)
            return out.replace("##", "")

        block = re.sub(rf"^{name}\(([^)]*)\)$", expand, block, flags=re.MULTILINE)
    return block


def c_signatures(source: Path) -> dict[str, tuple[str, list[str]]]:
    """``name -> (return type, parameter types)`` of the ``extern "C"`` definitions."""
    block = entry_block(source)
    found = {}
    for ret, name, params in DEFINITION.findall(block):
        kinds = []
        for param in filter(str.strip, params.split(",")):
            words = param.replace("const", " ").split()
            kind = " ".join(words[:-1]).replace(" *", "*")
            kinds.append("pointer" if "*" in param else kind)
        found[name] = (ret, kinds)
    return found


def native_only_names(source: Path) -> set[str]:
    """The ``extern "C"`` definitions the AVX2 build compiles out."""
    block = entry_block(source)
    return {
        name
        for guarded in NATIVE_BLOCK.findall(block)
        for _, name, _ in DEFINITION.findall(guarded)
    }


PART_BLOCK = re.compile(r"^#if PC_ROW_PART != (\d)\b.*?^#endif", re.MULTILINE | re.DOTALL)


def left_out_of(source: Path, library: cpu_library.CpuLibrary) -> set[str]:
    """The definitions a library built from part N of its source (``-DPC_ROW_PART=N``, the
    row attention's per-dtype libraries) compiles out: those under ``#if PC_ROW_PART != N``."""
    flags = set(library.flags)
    block = entry_block(source)
    return {
        name
        for excluded, guarded in ((m.group(1), m.group(0)) for m in PART_BLOCK.finditer(block))
        if f"-DPC_ROW_PART={excluded}" in flags
        for _, name, _ in DEFINITION.findall(guarded)
    }


def library_cases() -> list[tuple[str, Path, cpu_library.CpuLibrary]]:
    return [
        ("attention", cpu_kernels.SOURCE, cpu_kernels._library),
        ("row attention (bf16)", cpu_kernels.ROW_SOURCE, row_kernels._row_library),
        ("row attention (fp32)", cpu_kernels.ROW_SOURCE, row_kernels._row_f32_library),
        ("gemm", cpu_gemm.SOURCE, cpu_gemm._library),
        ("gemm on amx", cpu_gemm.AMX_SOURCE, cpu_gemm._amx_library),
        ("layer ops", cpu_layer_ops.SOURCE, cpu_layer_ops._library),
        ("quantized gemm", cpu_qgemm.SOURCE, cpu_qgemm._library),
        ("replay", cpu_replay.SOURCE, cpu_replay._library),
    ]


@pytest.mark.parametrize(
    ("label", "source", "library"), library_cases(), ids=[c[0] for c in library_cases()]
)
def test_every_entry_point_is_declared_as_the_cpp_defines_it(
    label: str, source: Path, library: cpu_library.CpuLibrary
) -> None:
    signatures = c_signatures(source)
    assert signatures, f'no extern "C" definitions found in {source.name}'
    lib = library.load()
    if lib is None:
        pytest.skip(f"the {label} kernel cannot load here: {library.unavailable_reason()}")
    assert library.target is not None
    narrow = "-DPC_NARROW_VECTORS" in library.target.flags
    compiled_out = native_only_names(source) if narrow else set()
    other_part = left_out_of(source, library)
    for name, (ret, kinds) in signatures.items():
        if name in compiled_out | other_part:
            assert not hasattr(lib, name), f"{name}: compiled out, yet the build has it"
            continue
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
        names = set(re.findall(r"\b(pc_\w+)\(", entry_block(source)))
        assert names == set(c_signatures(source)), source.name
        assert native_only_names(source) <= names, source.name


def test_the_row_attention_libraries_split_its_entries_by_dtype() -> None:
    """Each dtype's library leaves out the other's entries (and AMX's switch goes with bf16);
    both keep the K/V write."""
    source = cpu_kernels.ROW_SOURCE
    bf16, f32 = row_kernels._row_library, row_kernels._row_f32_library
    assert {"pc_row_attention_f32", "pc_row_attention_f32_e5m2"} <= left_out_of(source, bf16)
    assert {"pc_row_attention_bf16", "pc_row_enable_amx"} <= left_out_of(source, f32)
    assert not (left_out_of(source, bf16) | left_out_of(source, f32)) & {"pc_write_kv"}
    names = set(c_signatures(source))
    assert left_out_of(source, bf16) | left_out_of(source, f32) == names - {"pc_write_kv"}


def test_the_guard_parser_sees_the_bf16_only_entry_points() -> None:
    """The AVX2 build leaves bf16 SiLU-and-mul and the bf16 quantized GEMM out."""
    assert "pc_silu_and_mul_bf16" in native_only_names(cpu_layer_ops.SOURCE)
    assert {"pc_qgemm_bf16", "pc_qgemm_gather_bf16"} <= native_only_names(cpu_qgemm.SOURCE)
    assert "pc_rms_norm_bf16" in native_only_names(cpu_layer_ops.SOURCE)
    assert {"pc_rms_norm_f32", "pc_rotary_f32"} <= set(c_signatures(cpu_layer_ops.SOURCE))
    assert not native_only_names(cpu_layer_ops.SOURCE) & {"pc_rms_norm_f32", "pc_rotary_f32"}
