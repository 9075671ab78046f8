"""The peer's build (``benchmarks/llama_build.py``): a native build that dies on this CPU (SIGILL: a VM that
lists AMX but does not allow it) is rebuilt without GGML_NATIVE with the x86 options the CPU lists and AMX
off, and the flags of the build that ran are recorded beside the binary and with every result."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import llama_build  # noqa: E402

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse4_2 avx f16c fma bmi2 avx2\n"
# the AVX-512 and AMX flags of an Intel Xeon VM whose native llama-server died of SIGILL (2026-12-07)
AMX_XEON = ("flags\t\t: fpu sse4_2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512ifma avx512cd avx512bw "
            "avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq "
            "amx_bf16 avx512_fp16 amx_tile amx_int8\n")


def test_portable_flags_follow_the_cpu_and_leave_amx_off():
    epyc = llama_build.portable_flags(llama_build.cpu_flags(AVX2_EPYC))
    assert "-DGGML_NATIVE=OFF" in epyc and "-DGGML_AVX2=ON" in epyc and "-DGGML_FMA=ON" in epyc
    assert "-DGGML_AVX512=OFF" in epyc and "-DGGML_AVX512_VNNI=OFF" in epyc and "-DGGML_AVX_VNNI=OFF" in epyc
    xeon = llama_build.portable_flags(llama_build.cpu_flags(AMX_XEON))
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON",
            "-DGGML_AVX512_VBMI=ON"} <= set(xeon)
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(xeon)
    partial = llama_build.portable_flags(llama_build.cpu_flags("flags : avx2 avx512f\n"))
    assert "-DGGML_AVX512=OFF" in partial  # AVX-512 needs F, BW, DQ and VL
    assert llama_build.cpu_flags("no flags here\n") == set()


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_a_binary_that_dies_of_sigill_is_reported_with_its_signal(tmp_path):
    why = llama_build.try_server(_script(tmp_path / "llama-server", "kill -ILL $$"), timeout=20)
    assert why is not None and "SIGILL" in why
    why = llama_build.try_server(_script(tmp_path / "exits", "echo bad flag; exit 3"), timeout=20)
    assert why is not None and "exit code 3" in why and "bad flag" in why


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """build_llama_server with pip, tar and cmake stubbed: each build 'makes' binaries; the try of the
    native one fails with SIGILL."""
    monkeypatch.setattr(llama_build, "peer_dir", lambda: tmp_path / "peer")
    monkeypatch.setattr(llama_build.shutil, "which", lambda name: "/usr/bin/" + name)
    real = llama_build.cpu_flags
    monkeypatch.setattr(llama_build, "cpu_flags", lambda text=None: real(AMX_XEON if text is None else text))
    calls: list[list[str]] = []
    src = tmp_path / "work"

    def run(cmd, check=True):
        calls.append([str(c) for c in cmd])
        if "download" in cmd:
            (src / "pkg.tar.gz").write_bytes(b"")
        if "--build" in cmd:
            out = Path(cmd[cmd.index("--build") + 1]) / "bin"
            out.mkdir(parents=True, exist_ok=True)
            for tool in ("llama-server", "llama-quantize"):
                (out / tool).write_text("binary")

    class Tar:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def extractall(self, where, filter=None):
            (Path(where) / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp").mkdir(parents=True)

    src.mkdir()
    monkeypatch.setattr(llama_build.tempfile, "mkdtemp", lambda prefix="": str(src))
    monkeypatch.setattr(llama_build.subprocess, "run", run)
    monkeypatch.setattr(llama_build.tarfile, "open", Tar)
    tries = []

    def try_server(binary, timeout=180):
        tries.append(binary)
        native = any("-DGGML_NATIVE=ON" in c for c in calls[-2])
        return "it died on load (signal SIGILL): " if native else None

    monkeypatch.setattr(llama_build, "try_server", try_server)
    return calls, tries, tmp_path


def test_a_native_build_that_dies_is_rebuilt_portable_and_its_flags_are_recorded(fake_build):
    calls, tries, tmp_path = fake_build
    out = llama_build.build_llama_server()
    configures = [c for c in calls if "-S" in c]
    assert len(configures) == 2 and "-DGGML_NATIVE=ON" in configures[0]
    assert "-DGGML_NATIVE=OFF" in configures[1] and "-DGGML_AMX_INT8=OFF" in configures[1]
    assert "-DGGML_AVX512=ON" in configures[1]  # the (fake) CPU's AVX-512 kept
    info = llama_build.build_info(out)
    assert info is not None and info["flags"] == configures[1][configures[1].index("-DCMAKE_BUILD_TYPE=Release"):]
    assert [t["tried"].split(" (")[0] for t in info["tries"]] == ["it died on load", "answered"]
    assert json.loads((out.parent / "build.json").read_text()) == info
    assert len(tries) == 2
    calls.clear()
    assert llama_build.build_llama_server() == out and calls == []  # cached and recorded: nothing built again
