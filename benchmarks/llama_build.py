"""Building the peer: llama.cpp's ``llama-server`` and ``llama-quantize`` from the registry's
``llama-cpp-python`` sdist (which vendors llama.cpp), cached under ``<cache>/peer/``.

The first build is native (``-DGGML_NATIVE=ON``: every instruction set the compiler sees on this CPU).
Some cloud VMs list instruction sets they do not allow: an Intel Xeon whose flags show AMX
(``amx_tile``, ``amx_int8``) killed a native ``llama-server`` with SIGILL on load. So every build is tried
once - the server loads the bundled model and answers one request - and a build that dies is rebuilt
with ``-DGGML_NATIVE=OFF`` and the x86 options this CPU lists, AMX off (only ggml-cpu recompiles: ~30 s).
What was built, with which flags and whether its try passed, is written beside the binaries
(``build.json``) and recorded with every result that used it (``build_info``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import common

SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
BASE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"]
# ggml's x86 options and the /proc/cpuinfo flag each needs (all of them, for the AVX-512 ones), spelled as Linux
# spells them (avx512vbmi without an underscore, avx512_vnni and avx512_bf16 with one)
X86_OPTIONS = [("GGML_SSE42", ("sse4_2",)), ("GGML_AVX", ("avx",)), ("GGML_AVX2", ("avx2",)),
               ("GGML_FMA", ("fma",)), ("GGML_F16C", ("f16c",)), ("GGML_BMI2", ("bmi2",)),
               ("GGML_AVX_VNNI", ("avx_vnni",)), ("GGML_AVX512", ("avx512f", "avx512bw", "avx512dq", "avx512vl")),
               ("GGML_AVX512_VBMI", ("avx512vbmi",)), ("GGML_AVX512_VNNI", ("avx512_vnni",)),
               ("GGML_AVX512_BF16", ("avx512_bf16",))]
AMX_OFF = ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def peer_dir() -> Path:
    from opencoti.engine.paths import cache_root

    return cache_root() / "peer" / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}"


def cpu_flags(text: str | None = None) -> set[str]:
    """The CPU's flags (``/proc/cpuinfo``'s first ``flags`` line; ``text``: that file's content)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def portable_flags(flags: set[str]) -> list[str]:
    """CMake options for a build without ``GGML_NATIVE``: each x86 option on where the CPU lists what it
    needs, off where it does not; AMX always off (a VM may list it and not allow it)."""
    out = ["-DGGML_NATIVE=OFF"]
    for option, needs in X86_OPTIONS:
        out.append(f"-D{option}={'ON' if all(n in flags for n in needs) else 'OFF'}")
    return out + AMX_OFF


def build_info(binary: Path | None) -> dict | None:
    """What ``build.json`` beside ``binary`` says of its build (None: not a build made here)."""
    if binary is None:
        return None
    try:
        return json.loads((Path(binary).parent / "build.json").read_text())
    except (OSError, ValueError):
        return None


def try_server(binary: Path, timeout: float = 180) -> str | None:
    """Start ``binary`` on the bundled model and ask for two tokens. None when it answered, else why not
    (a signal it died of - SIGILL on an instruction the VM does not allow -, an exit code, a time-out)."""
    import httpx

    from opencoti.engine.model.loader import bundled_gguf_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    log = tempfile.NamedTemporaryFile(prefix="peer-try-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(binary), "-m", str(bundled_gguf_path()), "-c", "256", "-t", "2", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            rc = proc.poll()
            if rc is not None:
                try:
                    why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
                except ValueError:  # (a real-time signal has no name)
                    why = f"signal {-rc}"
                return f"it died on load ({why}): {Path(log.name).read_text()[-500:]}"
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hello", "n_predict": 2},
                               timeout=30)
                if r.status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return f"no answer within {timeout:.0f} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        Path(log.name).unlink(missing_ok=True)


def build_llama_server() -> Path:
    """The cached llama-server binary, built from the registry's sdist the first time (and tried)."""
    out = peer_dir() / "bin" / "llama-server"
    if out.exists() and (out.parent / "llama-quantize").exists():
        if build_info(out) is not None:
            return out
        problem = try_server(out)  # cached before builds were tried and recorded: try it now
        if problem is None:
            (out.parent / "build.json").write_text(json.dumps({
                "source": f"{SDIST}=={SDIST_VERSION}", "flags": BASE_FLAGS + ["-DGGML_NATIVE=ON"],
                "note": "cached before its flags were recorded: the native build of that time",
                "tries": [{"flags": None, "tried": "answered"}]}, indent=1))
            return out
        common.log(f"the cached llama-server does not run here ({problem[:120]}); building again")
        shutil.rmtree(out.parent)
    legacy = peer_dir().parent / f"{SDIST}-{SDIST_VERSION}" / "build" / "bin"
    if (legacy / "llama-server").exists() and try_server(legacy / "llama-server") is None:  # made by hand
        return _install(legacy, out, {"flags": None, "note": "a build made by hand, found at " + str(legacy),
                                      "tries": [{"flags": None, "tried": "answered"}]})
    if not shutil.which("cmake"):
        raise SystemExit("building llama-server needs cmake (apt-get install cmake)")
    work = Path(tempfile.mkdtemp(prefix="llama-build-"))
    common.log(f"downloading the {SDIST}=={SDIST_VERSION} sdist (llama.cpp's sources) ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"{SDIST}=={SDIST_VERSION}", "-d", str(work)], check=True)
    archive = next(work.glob("*.tar.gz"))
    with tarfile.open(archive) as tf:
        tf.extractall(work, filter="data")
    src = next(work.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
    build = work / "build"
    tries = []
    for flags in (["-DGGML_NATIVE=ON"], portable_flags(cpu_flags())):
        common.log(f"building llama-server (CMake Release, {' '.join(flags[:1])}; the first ~20 min on 2 cores) ...")
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *BASE_FLAGS, *flags], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j",
                        str(os.cpu_count() or 2)], check=True)
        problem = try_server(build / "bin" / "llama-server")
        tries.append({"flags": BASE_FLAGS + flags, "tried": problem or "answered"})
        if problem is None:
            break
        common.log(f"that llama-server does not run here ({problem[:120]}); rebuilding without GGML_NATIVE")
    else:
        raise SystemExit(f"no llama-server build runs on this CPU: {json.dumps(tries)[:2000]}")
    _install(build / "bin", out, {"flags": tries[-1]["flags"], "tries": tries})
    shutil.rmtree(work, ignore_errors=True)
    return out


def _install(bin_dir: Path, out: Path, info: dict) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    for lib in bin_dir.glob("*.so*"):  # shared ggml/llama libraries, when built shared
        shutil.copy2(lib, out.parent / lib.name)
    for tool in ("llama-server", "llama-quantize"):  # llama-quantize makes k-quant test models (scripts/)
        if (bin_dir / tool).exists():
            shutil.copy2(bin_dir / tool, out.parent / tool)
    (out.parent / "build.json").write_text(json.dumps({"source": f"{SDIST}=={SDIST_VERSION}", **info}, indent=1))
    return out
