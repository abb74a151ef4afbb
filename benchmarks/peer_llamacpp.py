"""llama.cpp as a peer: built natively from the `llama-cpp-python` sdist, its GGUF files and its rows.

The sdist (PyPI has no CPU wheels of it) carries llama.cpp's source under vendor/llama.cpp and its
`convert_hf_to_gguf.py`. We fetch it with pip (`pip download --no-binary llama-cpp-python --no-deps`,
the ordinary client) into .llama-src/, build llama-bench, llama-server and llama-quantize with cmake
and GGML_NATIVE=ON into .llama-build/ (both git-ignored, never inside .venv), write the model's
weights as F32, BF16 and F16 GGUF with the sdist's converter, and quantize Q8_0 from the F32 file
with llama.cpp's own tool. Every step returns an error string instead of raising: a peer that cannot
be built is reported, and our side still runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / ".llama-src"
BUILD = ROOT / ".llama-build"
SDIST_SPEC = "llama-cpp-python==0.3.36"
TARGETS = ["llama-bench", "llama-quantize", "llama-server"]


def _run(cmd: list[str], log: Path, timeout: float, **kw) -> str:
    """'' on success, else the failing command and the tail of its output."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        try:
            r = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, timeout=timeout, **kw)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{cmd[0]}`: {type(exc).__name__}: {exc}"
    if r.returncode != 0:
        return f"`{' '.join(map(str, cmd))[:200]}` failed (rc {r.returncode}); tail of {log}:\n" + \
            "\n".join(log.read_text(errors="ignore").splitlines()[-15:])
    return ""


def source_dir(log: Path) -> tuple[Path | None, str]:
    """vendor/llama.cpp of the extracted sdist, downloading and extracting it first if needed."""
    found = sorted(SRC.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parent, ""
    SRC.mkdir(exist_ok=True)
    err = _run([sys.executable, "-m", "pip", "download", "--no-binary", "llama-cpp-python", "--no-deps",
                SDIST_SPEC, "-d", str(SRC)], log, 1800)
    tars = sorted(SRC.glob("llama_cpp_python-*.tar.gz"))
    if err or not tars:
        return None, err or "pip download left no sdist"
    with tarfile.open(tars[-1]) as t:
        t.extractall(SRC, filter="data")
    found = sorted(SRC.glob("llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    return (found[-1].parent, "") if found else (None, "the sdist has no vendor/llama.cpp")


def tools() -> tuple[Path | None, str]:
    """The build's bin folder (building llama.cpp natively first if needed), else why not."""
    bin_dir = BUILD / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir, ""
    log = ROOT / "runs" / "llama-build.log"
    log.parent.mkdir(exist_ok=True)
    src, err = source_dir(log)
    if src is None:
        return None, err
    cmake = shutil.which("cmake")
    if cmake is None:
        return None, "no cmake on PATH (pip install cmake ninja provides both as wheels)"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    err = _run([cmake, "-S", src, "-B", BUILD, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=OFF"], log, 900)
    if not err:
        err = _run([cmake, "--build", BUILD, "-j", str(os.cpu_count()), "--target", *TARGETS], log, 3600)
    return (bin_dir, "") if not err else (None, err)


def ggufs(model_dir: Path, name: str, shipped: Path | None, bin_dir: Path) -> tuple[dict[str, Path], list[str]]:
    """{label: gguf path} of the model's weights: F32/BF16/F16 written by the sdist's
    convert_hf_to_gguf.py, Q8_0 by llama-quantize from F32, and `shipped` (the GGUF the model was
    imported from, if any) as its own row. Returns the files made and the reasons for those not made."""
    out = BUILD / "gguf" / name
    out.mkdir(parents=True, exist_ok=True)
    log = ROOT / "runs" / "llama-gguf.log"
    src = next(iter(sorted(SRC.glob("llama_cpp_python-*/vendor/llama.cpp"))), None)
    files: dict[str, Path] = {}
    why: list[str] = []
    for label in ("F32", "BF16", "F16"):
        f = out / f"{name}-{label}.gguf"
        if not f.is_file() and src is not None:
            env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
            err = _run([sys.executable, src / "convert_hf_to_gguf.py", model_dir, "--outtype", label.lower(),
                        "--outfile", f], log, 1800, env=env)
            if err and shipped is not None and shipped.is_file():
                # the converter can need packages .venv lacks (sentencepiece for a vocabulary it reads that
                # way): the shipped GGUF dequantized by llama-quantize instead, the weights ours imported
                f.unlink(missing_ok=True)
                print(f"  {label}: convert_hf_to_gguf.py failed ({err.splitlines()[0][:120]}); "
                      f"llama-quantize --allow-requantize of {shipped.name} instead", flush=True)
                err = _run([bin_dir / "llama-quantize", "--allow-requantize", shipped, f, label], log, 1800)
            if err:
                f.unlink(missing_ok=True)
                why.append(f"{label}: {err.splitlines()[0]} (see {log})")
        if f.is_file():
            files[label] = f
    q8 = out / f"{name}-Q8_0.gguf"
    if not q8.is_file() and "F32" in files:
        err = _run([bin_dir / "llama-quantize", files["F32"], q8, "Q8_0"], log, 1800)
        if err:
            why.append(f"Q8_0: {err.splitlines()[0]}")
    if q8.is_file():
        files["Q8_0"] = q8
    if shipped is not None and shipped.is_file():
        files[f"{shipped.stem.rsplit('.', 1)[-1]} (as shipped)"] = shipped
    return files, why


def bench(bin_dir: Path, gguf: Path, threads: int, repeats: int = 3, n_gen: int = 96, gens: int = 1) -> dict:
    """llama-bench's batch-1 decode: tg`n_gen` (greedy-free token generation from an empty context),
    `repeats` repetitions of `gens` timed generations each after its warm-up; a repetition's tok/s is
    its generations' tokens over their time (as peer_worker's --b1-gens), with the CPU it reports."""
    cmd = [bin_dir / "llama-bench", "-m", gguf, "-p", "0", "-n", str(n_gen), "-t", str(threads),
           "-r", str(repeats * gens), "-o", "json"]
    try:
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1200)
        rows = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not rows:
        return {"error": f"llama-bench rc {r.returncode}: {r.stderr[-800:]}"}
    row = rows[-1]
    each = row["samples_ts"]
    samples = [len(g) / sum(1 / r for r in g) for g in (each[i:i + gens] for i in range(0, len(each), gens))]
    return {"samples": samples, "generations": each, "cpu_info": row.get("cpu_info", ""),
            "backends": row.get("backends", ""), "type": row.get("model_type", ""), "build": row.get("build_commit", "")}


def server_cmd(bin_dir: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """llama-server with `slots` parallel slots and continuous batching (its default), the KV pool
    sized for every slot's whole context (`slots * ctx_per_slot` tokens), every core."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
            "--no-webui", "-a", "peer"]
