"""A trimmed FlashInfer wheel for a GPU machine that can receive only a few tens of MiB.

    python plugins/cuda/flashinfer_bundle.py trim WHEEL OUT_DIR     # writes OUT_DIR/<same name>.whl
    python plugins/cuda/flashinfer_bundle.py check WHEEL_DIR         # import it and plan its modules

FlashInfer's wheel (0.7.4: about 101 MB, 715 MB unpacked) carries the Python code and the CUDA
sources of every kernel family; the cuda backend uses only its sampling module (and the top-k
module of the ``top_k_first`` fast path), which FlashInfer compiles with nvcc on first use.
``trim`` keeps:

- the Python modules that ``flashinfer``, ``flashinfer.sampling`` and ``flashinfer.topk`` can
  import, found by following every import statement (at any depth in a file) from them and
  from ``flashinfer.jit``: a superset of what runs;
- the CUDA sources of those JIT modules (``gen_sampling_module``, ``gen_topk_module``) and every
  header they can include, found by following ``#include`` lines (conditionals ignored, so
  again a superset) through FlashInfer's include folders (its own, CCCL, CUTLASS, spdlog);
  headers found in none of them are the CUDA toolkit's, the C++ library's or tvm-ffi's;
- the dist-info, with RECORD rewritten for the files kept and the dependencies reduced to what
  the kept modules import (apache-tvm-ffi, numpy, requests, nvidia-ml-py, tqdm, ninja, packaging).

``check`` installs the wheels of a folder (``--no-deps``) into a scratch folder, then in a fresh
interpreter that sees only that folder, torch and torch's own dependencies (``-S``: the GPU
machine has no other packages), imports FlashInfer, plans both JIT modules for sm90 (their
build.ninja, no compiler needed) and checks that every source they list and every header the
sources reach exists in the installed copy.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

#: JIT modules the backend's kernels come from, and their sources under data/csrc (0.7.4).
JIT_SOURCES = {
    "sampling": ["sampling.cu", "renorm.cu", "flashinfer_sampling_binding.cu"],
    "topk": ["topk.cu", "cub_topk.cu", "flashinfer_topk_binding.cu",
             "flashinfer_fast_topk_clusters_binding.cu"],
}
#: Include folders of FlashInfer's JIT builds, relative to the package (its build.ninja's -I
#: and -isystem, tvm-ffi's and the toolkit's aside).
INCLUDE_DIRS = ["data/cccl/cub", "data/cccl/libcudacxx/include", "data/cccl/thrust", "data/include",
                "data/csrc", "data/cutlass/include", "data/cutlass/tools/util/include",
                "data/spdlog/include"]
ROOT_MODULES = ["flashinfer", "flashinfer.sampling", "flashinfer.topk", "flashinfer.jit",
                "flashinfer.jit.sampling", "flashinfer.jit.topk"]
#: What the kept modules import beyond torch and the standard library (checked by ``check``).
REQUIRES = ["apache-tvm-ffi<0.2,>=0.1.11", "numpy", "requests", "nvidia-ml-py", "tqdm", "ninja",
            "packaging>=24.2"]
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


# ---------------------------------------------------------------------- python modules
def module_file(root: pathlib.Path, module: str) -> pathlib.Path | None:
    base = root.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(root: pathlib.Path, module: str, path: pathlib.Path) -> set[str]:
    """flashinfer modules a file may import (every import statement, relative ones resolved;
    ``from X import y`` counts X.y too, in case y is a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    closure = set()
    for name in found:
        if name.split(".")[0] != "flashinfer":
            continue
        parts = name.split(".")          # a.b.c imports a and a.b too
        closure.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return closure


def python_closure(root: pathlib.Path) -> set[pathlib.Path]:
    seen, todo, files = set(), list(ROOT_MODULES), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = module_file(root, module)
        if path is None:
            continue
        files.add(path)
        todo.extend(imported_modules(root, module, path) - seen)
    return files


# ---------------------------------------------------------------------- cuda sources
def header_closure(package: pathlib.Path, sources: list[pathlib.Path]) -> tuple[set[pathlib.Path], set[str]]:
    """(files reached from ``sources`` through #include, includes found in none of FlashInfer's
    folders)."""
    dirs = [package / d for d in INCLUDE_DIRS]
    files, outside, todo = set(), set(), list(sources)
    while todo:
        path = todo.pop()
        if path in files:
            continue
        files.add(path)
        for kind, name in INCLUDE.findall(path.read_text(errors="replace")):
            where = ([path.parent] if kind == '"' else []) + dirs
            target = next((d / name for d in where if (d / name).is_file()), None)
            if target is None:
                outside.add(name)
            elif target.resolve() not in files:
                todo.append(target.resolve())
    return files, outside


# ---------------------------------------------------------------------- trim
def _record_line(rel: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def trim(wheel: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
        package = (root / "flashinfer").resolve()
        py = python_closure(root)
        sources = [package / "data" / "csrc" / s for ss in JIT_SOURCES.values() for s in ss]
        headers, outside = header_closure(package, sources)
        dist_info = next(root.glob("flashinfer_python-*.dist-info"))
        keep = sorted({p.resolve() for p in py} | headers)
        target = out_dir / wheel.name
        record = []
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for path in keep:
                rel = path.relative_to(root.resolve()).as_posix()
                data = path.read_bytes()
                z.writestr(rel, data)
                record.append(_record_line(rel, data))
            for folder in INCLUDE_DIRS:
                # FlashInfer passes every include folder to nvcc; keep each one, even where
                # none of its headers is reached.
                rel = f"flashinfer/{folder}/.corelib-keep"
                z.writestr(rel, b"")
                record.append(_record_line(rel, b""))
            for path in sorted(dist_info.rglob("*")):
                if not path.is_file() or path.name == "RECORD":
                    continue
                rel = path.relative_to(root).as_posix()
                data = path.read_bytes()
                if path.name == "METADATA":
                    data = _metadata(data.decode()).encode()
                z.writestr(rel, data)
                record.append(_record_line(rel, data))
            rel = f"{dist_info.name}/RECORD"
            z.writestr(rel, "\n".join(record + [f"{rel},,"]) + "\n")
        print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB; {len(py)} Python modules, "
              f"{len(headers)} CUDA sources and headers (from {wheel.stat().st_size / 2**20:.1f} MiB)")
        print(f"{len(outside)} includes left to the CUDA toolkit, the C++ library and tvm-ffi "
              f"(or under conditions never true for them), e.g. "
              + " ".join(sorted(outside)[::max(1, len(outside) // 8)]))
        return target


def _metadata(text: str) -> str:
    head = [line for line in text.split("\n\n", 1)[0].splitlines()
            if not line.startswith(("Requires-Dist:", "Provides-Extra:"))]
    head += [f"Requires-Dist: {r}" for r in REQUIRES]
    head.append("Summary-Note: trimmed to the sampling and top-k JIT modules by corelib-cuda's bundle tool")
    return "\n".join(head) + "\n"


# ---------------------------------------------------------------------- check
CHECK = r"""
import pathlib, re, sys
import flashinfer, flashinfer.sampling, flashinfer.topk
from flashinfer.jit.sampling import gen_sampling_module
from flashinfer.jit.topk import gen_topk_module
sys.path.insert(0, sys.argv[1])
from flashinfer_bundle import header_closure
package = pathlib.Path(flashinfer.__file__).resolve().parent
print(f"flashinfer {flashinfer.__version__} from {package}")
third_party = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)
                     - {'flashinfer', 'flashinfer_bundle', 'torch', '__main__'})
print("imported besides torch and the standard library:", " ".join(third_party))
bad = 0
for gen in (gen_sampling_module, gen_topk_module):
    spec = gen()
    spec.write_ninja()
    sources = [pathlib.Path(s) for s in spec.sources]
    missing = [s for s in sources if not s.is_file()]
    files, outside = header_closure(package, [s for s in sources if s.is_file()])
    ninja = spec.ninja_path.read_text()
    dirs = re.findall(r"(?:-I|-isystem )(\S+)", ninja)
    gone = [d for d in dirs if d.startswith(str(package)) and not pathlib.Path(d).is_dir()]
    print(f"module {spec.name}: {len(sources)} sources, {len(files)} files reached, "
          f"missing sources {missing or 'none'}, missing include folders {gone or 'none'}; "
          f"{len(outside)} includes outside it (the toolkit's, the C++ library's, tvm-ffi's)")
    # tvm-ffi's headers come from its wheel: they must be in one of the planned folders.
    ffi = [n for n in outside if n.startswith(("tvm/", "dlpack/"))
           and not any((pathlib.Path(d) / n).is_file() for d in dirs)]
    print(f"module {spec.name}: tvm-ffi headers missing: {ffi or 'none'}")
    bad += len(missing) + len(gone) + len(ffi)
sys.exit(1 if bad else 0)
"""

#: Distributions of the GPU machine besides torch's own requirements: pytest and pluggy.
MACHINE_EXTRAS = ["pytest", "pluggy", "iniconfig", "packaging"]


def machine_path(scratch: pathlib.Path) -> pathlib.Path:
    """A folder of links to torch and its requirements (and pytest's), the packages a GPU
    machine's Python has: the check runs with ``-S`` and sees only these and the bundle."""
    from importlib import metadata
    links = scratch / "machine"
    links.mkdir()
    names, todo = set(), ["torch"] + MACHINE_EXTRAS
    while todo:
        name = re.split(r"[ ;<>=!~\[]", todo.pop())[0].lower().replace("_", "-")
        if name in names:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        names.add(name)
        todo.extend(r for r in (dist.requires or []) if "extra ==" not in r)
        tops = (dist.read_text("top_level.txt") or "").split()
        if not tops:   # no top_level.txt: the first path component of its files
            tops = sorted({f.parts[0].removesuffix(".py") for f in dist.files or []
                           if not f.parts[0].endswith((".dist-info", ".data")) and f.parts[0] != ".."})
        for top in tops:
            for candidate in (top, f"{top}.py"):
                source = pathlib.Path(dist.locate_file(candidate))
                if source.exists() and not (links / candidate).exists():
                    (links / candidate).symlink_to(source)
    return links


def check(wheel_dir: pathlib.Path) -> int:
    wheels = sorted(str(w) for w in wheel_dir.glob("*.whl"))
    with tempfile.TemporaryDirectory() as tmp:
        scratch = pathlib.Path(tmp)
        site = scratch / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(site), *wheels], check=True)
        env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{machine_path(scratch)}",
                   FLASHINFER_CUDA_ARCH_LIST="9.0", FLASHINFER_WORKSPACE_BASE=str(scratch / "ws"),
                   PYTHONNOUSERSITE="1")
        here = str(pathlib.Path(__file__).resolve().parent)
        return subprocess.run([sys.executable, "-S", "-c", CHECK, here], env=env, cwd=tmp).returncode


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "trim":
        trim(pathlib.Path(argv[1]), pathlib.Path(argv[2]))
        return 0
    if len(argv) == 2 and argv[0] == "check":
        return check(pathlib.Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
