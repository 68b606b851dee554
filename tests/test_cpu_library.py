"""Which build of the C++ kernels a CPU gets (``cpu_library.select_target``): AVX512_BF16
natively, else AVX2 through SIMDe, else a reason that names what is missing."""

from __future__ import annotations

import dataclasses
import subprocess
import time
from pathlib import Path

import pytest
import torch

from prefixcache.engine import settings
from prefixcache.engine.attention import cpu_kernels, row_kernels
from prefixcache.engine.config import EngineConfig
from prefixcache.engine.kernels import cpu_gemm, cpu_layer_ops, cpu_library, cpu_qgemm
from prefixcache.engine.step.model_setup import kernel_loads

AVX512 = "flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16\n"
AVX2 = "flags\t\t: fpu sse2 avx avx2 fma f16c\n"
OLD = "flags\t\t: fpu sse2 avx\n"


@pytest.fixture
def simde(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether SIMDe counts as installed (a list to flip inside a test); g++ as the compiler."""
    found = [True]
    monkeypatch.delenv(settings.CPU_KERNELS_ENV, raising=False)
    monkeypatch.setattr(cpu_library, "compiler", lambda: "g++")
    monkeypatch.setattr(cpu_library, "simde_found", lambda cxx: found[0])
    return found


def test_each_cpu_gets_its_best_build(simde: list[bool]) -> None:
    assert cpu_library.select_target(AVX512) is cpu_library.AVX512_BF16
    assert cpu_library.select_target(AVX2) is cpu_library.AVX2
    simde[0] = False
    assert cpu_library.select_target(AVX512) is cpu_library.AVX512_BF16  # needs no SIMDe
    reason = cpu_library.select_target(AVX2)
    assert isinstance(reason, str)
    assert "avx512_bf16" in reason and "libsimde-dev" in reason
    assert cpu_library.unavailable_reason(AVX2) == reason


def test_a_cpu_without_avx2_is_told_what_it_lacks(simde: list[bool]) -> None:
    reason = cpu_library.select_target(OLD)
    assert isinstance(reason, str)
    assert "avx2, f16c, fma (avx2)" in reason and "avx512f" in reason


def test_the_bf16_only_libraries_leave_avx2_to_torch(simde: list[bool]) -> None:
    only = cpu_library.NATIVE_ONLY
    assert cpu_library.select_target(AVX512, only) is cpu_library.AVX512_BF16
    assert isinstance(cpu_library.select_target(AVX2, only), str)
    assert cpu_kernels._library.targets == only  # bf16 only, for speed
    assert cpu_kernels._library.unavailable_reason(AVX2) is not None
    # batch invariance on AVX2; the layer ops and quantized GEMM build there for fp32 only
    for library in (
        cpu_gemm._library,
        row_kernels._row_library,
        row_kernels._row_f32_library,
        cpu_layer_ops._library,
        cpu_qgemm._library,
    ):
        assert library.targets == cpu_library.TARGETS and library.unavailable_reason(AVX2) is None


def test_the_setting_forces_the_avx2_build_or_turns_all_off(
    simde: list[bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(settings.CPU_KERNELS_ENV, "avx2")
    assert cpu_library.select_target(AVX512) is cpu_library.AVX2
    # the bf16-only libraries too: the emulation's bits can be checked on any machine
    assert cpu_library.select_target(AVX512, cpu_library.NATIVE_ONLY) is cpu_library.AVX2
    monkeypatch.setenv(settings.CPU_KERNELS_ENV, "0")
    assert cpu_library.select_target(AVX512) == f"{settings.CPU_KERNELS_ENV}=0"
    monkeypatch.setenv(settings.CPU_KERNELS_ENV, "avx2")
    simde[0] = False
    assert "libsimde-dev" in str(cpu_library.select_target(AVX512))


def test_no_compiler_is_a_reason(simde: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_library, "compiler", lambda: None)
    assert "no C++ compiler" in str(cpu_library.select_target(AVX2))


def test_the_target_is_part_of_the_library_name(tmp_path: Path) -> None:
    cxx = cpu_library.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    lib = cpu_library.CpuLibrary(source, "t", "t", lambda lib: None)
    wide = lib.library_path(cxx, cpu_library.AVX512_BF16)
    narrow = lib.library_path(cxx, cpu_library.AVX2)
    assert wide != narrow
    assert "-avx2-" in narrow.name and "-avx512_bf16-" in wide.name


def test_the_shim_builds_with_simde_where_it_is_installed() -> None:
    """The AVX2 build's force-included header compiles against SIMDe (the real one)."""
    cxx = cpu_library.compiler()
    if cxx is None or not cpu_library.simde_found(cxx):
        pytest.skip("no compiler or no SIMDe (apt install libsimde-dev)")
    done = subprocess.run(
        [cxx, "-x", "c++", "-fsyntax-only", *cpu_library.AVX2.flags, "-"],
        input="#include <cstdint>\nint main() { return 0; }\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_libraries_build_side_by_side_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``load_in_background`` builds each library on its own threads; the later ``load()``
    finds it built (one build each) and loaded."""
    if cpu_library.compiler() is None or isinstance(cpu_library.select_target(), str):
        pytest.skip("no compiler or no kernel target on this CPU")
    monkeypatch.setenv(settings.HOME_ENV, str(tmp_path / "home"))
    libs = []
    for i in range(3):
        source = tmp_path / f"k{i}.cpp"
        source.write_text(f'extern "C" int f{i}() {{ return {i}; }}\n')
        libs.append(cpu_library.CpuLibrary(source, f"t{i}", "t", lambda lib: None))
    built: list[str] = []
    build = cpu_library.CpuLibrary._build

    def counted(self: cpu_library.CpuLibrary, cxx: str, target: object, path: Path) -> None:
        built.append(self.label)
        build(self, cxx, target, path)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_library.CpuLibrary, "_build", counted)
    cpu_library.load_in_background([lib.load for lib in libs])
    deadline = time.monotonic() + 120
    while any(lib.target is None for lib in libs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(lib.target is not None for lib in libs), "the background builds did not finish"
    for i, lib in enumerate(libs):
        assert getattr(lib.load(), f"f{i}")() == i
    assert sorted(built) == ["t0", "t1", "t2"]


def test_a_librarys_own_flags_select_its_entries_and_name_its_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flags``: one source, two libraries (the row attention's per dtype); a build that
    fails says why (the load falls back) and leaves no file behind."""
    if cpu_library.compiler() is None or isinstance(cpu_library.select_target(), str):
        pytest.skip("no compiler or no kernel target on this CPU")
    monkeypatch.setenv(settings.HOME_ENV, str(tmp_path / "home"))
    source = tmp_path / "parts.cpp"
    source.write_text(
        'extern "C" {\n#if PART != 2\nint one() { return 1; }\n#endif\n'
        "#if PART != 1\nint two() { return 2; }\n#endif\n}\n"
        "#if PART == 3\n#error part three\n#endif\n"
    )
    libs = [
        cpu_library.CpuLibrary(source, f"part {i}", "t", lambda lib: None, flags=(f"-DPART={i}",))
        for i in (1, 2)
    ]
    first, second = (lib.load() for lib in libs)
    assert first is not None and first.one() == 1 and not hasattr(first, "two")
    assert second is not None and second.two() == 2 and not hasattr(second, "one")
    assert libs[0].library_path("g++") != libs[1].library_path("g++")  # the flags are in the key
    broken = cpu_library.CpuLibrary(source, "broken", "t", lambda lib: None, flags=("-DPART=3",))
    assert broken.load() is None and broken.target is None
    kernels = tmp_path / "home" / "kernels"
    assert sorted(p.suffix for p in kernels.iterdir()) == [".so", ".so"]


@pytest.mark.parametrize("name", ["auto", "cpu", "cpu-split", "torch"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_an_engine_builds_early_the_attention_library_its_backend_loads(
    name: str, batch_invariant: bool
) -> None:
    from prefixcache.engine.attention import cpu_kernel_loads, create_backend
    from prefixcache.engine.attention.cpu_backend import CpuKernelBackend
    from prefixcache.engine.attention.split_backend import SplitKernelBackend

    backend = create_backend(name, "cpu", batch_invariant=batch_invariant)
    for dtype in (torch.bfloat16, torch.float32):
        loads = cpu_kernel_loads(name, batch_invariant, dtype)
        rows = [f for f in loads if getattr(f, "func", None) is row_kernels.load_rows]
        assert bool(rows) == isinstance(backend, CpuKernelBackend)
        assert all(f.args == (dtype,) for f in rows)  # only its own rows' library
        assert (cpu_kernels.load in loads) == isinstance(backend, SplitKernelBackend)
        config = EngineConfig(
            model="demo",
            attention_backend=name,
            batch_invariant=batch_invariant,
            dtype=str(dtype).removeprefix("torch."),
        )
        built = kernel_loads(config)
        assert [f.args for f in built if getattr(f, "func", None) is row_kernels.load_rows] == [
            f.args for f in rows
        ]
        assert (cpu_kernels.load in built) == (cpu_kernels.load in loads)
        assert kernel_loads(dataclasses.replace(config, device="cuda")) == []
