"""Compile every cuda_src module through NVRTC exactly as CupyBackend does (same source inlining, same
options), without a GPU: NVRTC has no host std headers, so this catches what nvcc lets through.
Needs the `nvidia-cuda-nvrtc` wheel and the CUDA headers (CUDA_HOME/include, default /usr/local/cuda).

    python scripts/nvrtc_check.py                   # every module, for compute_90a (H100 / H200)
    python scripts/nvrtc_check.py --arch compute_80  # another virtual architecture

Prints ok / FAIL per module (and NVRTC's log on a failure or a warning); exits 1 if any module failed."""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig

from mtp_cupy.bench.cli import Parser, run_main
from mtp_cupy.runtime.backend import cuda_modules, module_source
from mtp_cupy.runtime.cupy_backend import NVRTC_OPTIONS


def load_nvrtc():
    pat = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "**", "libnvrtc.so*")
    found = sorted(p for p in glob.glob(pat, recursive=True) if ".alt." not in p)
    libs = [p for p in found if "builtins" not in p]
    if not libs:
        raise SystemExit("nvrtc_check: libnvrtc not found (pip install nvidia-cuda-nvrtc)")
    libdir = os.path.dirname(libs[0])
    if libdir not in os.environ.get("LD_LIBRARY_PATH", "").split(":"):  # NVRTC dlopens its builtins by name
        env = dict(os.environ, LD_LIBRARY_PATH=libdir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return ctypes.CDLL(libs[0])


def compile_one(lib, name: str, src: str, opts: list[str]) -> tuple[bool, str]:
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{name}.cu".encode(), 0, None, None):
        return False, "nvrtcCreateProgram failed"
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace").strip()


def main() -> int:
    p = Parser(__doc__)
    p.add_argument("--arch", default="compute_90a", help="NVRTC's -arch (a virtual architecture)")
    a = p.parse_args()
    lib = load_nvrtc()
    inc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
    opts = [*NVRTC_OPTIONS, f"-arch={a.arch}", f"-I{inc}"]
    fail = 0
    for m in cuda_modules():
        ok, log = compile_one(lib, m, module_source(m), opts)
        print(f"{'ok  ' if ok else 'FAIL'} nvrtc {m}.cu")
        if not ok or "warning" in log:
            print(log)
        fail |= not ok
    return fail


if __name__ == "__main__":
    run_main(main)
