"""Build the FlashInfer bundle that a GPU run of gpu_check.py carries (the GPU machine has no network).

The GPU machine's image has CUDA (nvcc), PyTorch, ninja, nvidia-ml-py and cuda-bindings but no
flashinfer. flashinfer-python's wheel is ~100 MB (680 MB unpacked), over the 64 MiB a run can
carry, and nearly all of it is CUDA sources for kernels we never build (MoE, GEMM, MLA, fp4/fp8,
Blackwell). This script downloads flashinfer-python and apache-tvm-ffi (the only other package
``import flashinfer`` needs there) for that machine's Python, unpacks them, drops the
kernel sources outside the attention path (keeps every .py file, every data file that is not
CUDA/C++ source, ``data/include``, ``data/cutlass``, ``data/cccl`` and the top-level files of
``data/csrc``, where the paged prefill/decode/cascade/page JIT sources live), and writes one
tar.xz (~20 MB) under ``.cache/gpu_bundle/`` (git-ignored; name it in the run's ``carry``).

    .venv/bin/python benchmarks/gpu_bundle.py
    # then, on the GPU machine (carry: .cache/gpu_bundle):
    python3 -c "import tarfile; tarfile.open('.cache/gpu_bundle/flashinfer-site.tar.xz').extractall('/tmp/site', filter='data')" && \\
      PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CUDA_SOURCE = (".cu", ".cuh", ".h", ".hpp", ".c", ".cc", ".cpp", ".inc", ".jinja")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def keep(rel: str) -> bool:
    """Whether a file of the unpacked site goes into the bundle."""
    parts = rel.split("/")
    if parts[0] != "flashinfer":
        return True
    if rel.startswith("flashinfer/data/"):
        return parts[2] != "csrc" or len(parts) == 4  # csrc: the top-level (attention, page, cascade) sources
    return not rel.endswith(CUDA_SOURCE)


def download(spec: str, python: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--implementation", "cp", "-d", str(dest), spec]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    before = set(dest.glob("*.whl"))
    subprocess.run(cmd, check=True)
    name = spec.split("==")[0].replace("-", "_").lower()
    found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(name)]
    new = [w for w in found if w not in before] or found
    if not new:
        raise SystemExit(f"no wheel for {spec}")
    return new[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flashinfer", default="0.7.4", help="flashinfer-python version")
    p.add_argument("--tvm-ffi", default="0.1.15.post2", help="apache-tvm-ffi version (flashinfer needs <0.2, >=0.1.11)")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    p.add_argument("--out", default=str(REPO / ".cache" / "gpu_bundle" / "flashinfer-site.tar.xz"))
    p.add_argument("--wheels", default=None, help="directory with the wheels already downloaded")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        wheel_dir = Path(args.wheels) if args.wheels else tmp / "wheels"
        wheel_dir.mkdir(exist_ok=True)
        wheels = [download(f"flashinfer-python=={args.flashinfer}", args.python, wheel_dir),
                  download(f"apache-tvm-ffi=={args.tvm_ffi}", args.python, wheel_dir)]
        site = tmp / "site"
        kept = dropped = 0
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                for info in z.infolist():
                    if info.is_dir():
                        continue
                    if keep(info.filename):
                        z.extract(info, site)
                        kept += info.file_size
                    else:
                        dropped += info.file_size
        tar_tmp = out.with_suffix(".tmp")
        with tarfile.open(tar_tmp, "w:xz", preset=6) as tar:
            for path in sorted(site.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=str(path.relative_to(site)))
        shutil.move(tar_tmp, out)
    size = out.stat().st_size
    print(f"{out}: {size / 2**20:.1f} MiB ({kept / 2**20:.0f} MiB unpacked; {dropped / 2**20:.0f} MiB of unused "
          f"kernel sources left out) from {', '.join(w.name for w in wheels)}")
    if size > 48 * 2**20:
        raise SystemExit("bundle too large to carry next to the working tree (64 MiB in all)")


if __name__ == "__main__":
    main()
