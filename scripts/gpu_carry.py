"""Gathers what the GPU check (scripts/gpu_check.sh) takes to a GPU machine that has no network.

That machine's image has CPython 3.12 on x86-64 with torch, Triton, transformers, tokenizers,
safetensors, numpy, msgpack, prometheus-client, uvloop and pytest (with pytest-xdist), but not
pdserve's HTTP and messaging stack. This writes, into DEST (default .gpu-carry, git-ignored):

- ``wheels/``: cp312 manylinux x86-64 wheels of that stack at the versions installed beside this
  script's interpreter (the project's .venv, as CI installs it). Requirements shared with the
  image (anyio, h11, httpx, typing-extensions, ...) are carried too, so the stack is the set of
  versions CI runs together, whatever versions the image has. Every wheel's requirements are
  checked against the others, so a missing one fails here rather than there;
- ``SmolLM2-135M-Instruct/``: the default model's config and tokenizer. Its weights (270 MB) are
  more than a GPU run may carry (64 MiB with the repo), so the check serves random weights of the
  same shape (``python -m benchmarks.harness random-model``);
- ``base/``, with ``--base COMMIT``: the source tree at that commit, whose decode steps the
  check's graphs step times first, on the same machine and model as the checkout's, for a
  change's before and after in one run (left out, an earlier one is removed).

    python scripts/gpu_carry.py --model "$(pdserve convert)"    # make gpu-carry [BASE=COMMIT]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

# pdserve's own needs that the image lacks, then what they need in turn.
WHEELS = [
    "pyzmq",
    "fastapi",
    "uvicorn",
    "httptools",  # router/http_protocol.py builds on uvicorn's httptools protocol
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "annotated-doc",
    "typing-inspection",
    "typing-extensions",
    "opentelemetry-api",
    "anyio",
    "idna",
    "click",
    "h11",
    "httpx",  # the benchmarks' HTTP client (benchmarks/harness.py, benchmarks/serving/load.py)
    "httpcore",
    "certifi",
]
# Requirements the image meets itself (its package list, checked by scripts/gpu_check.sh there).
IMAGE_PACKAGES = {"numpy", "torch", "triton", "transformers", "msgpack", "uvloop", "packaging"}
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# The GPU machine's interpreter, for evaluating requirement markers.
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def download_wheels(folder: Path) -> list[Path]:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
         *platforms, "--dest", str(folder), *pins],
        check=True,
    )  # fmt: skip
    return sorted(folder.glob("*.whl"))


def unmet_requirements(wheels: list[Path]) -> list[str]:
    """Each wheel's requirement (extras aside) that no carried wheel and no image package meets."""
    carried = {}
    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        carried[name] = version
    problems = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            lines = archive.read(metadata).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
            if requirement.marker is not None and not requirement.marker.evaluate(TARGET):
                continue
            name = canonicalize_name(requirement.name)
            if name in IMAGE_PACKAGES:
                continue
            if name not in carried:
                problems.append(f"{wheel.name} needs {requirement}, which is not carried")
            elif not requirement.specifier.contains(carried[name], prereleases=True):
                problems.append(f"{wheel.name} needs {requirement}, carried {carried[name]}")
    return problems


def copy_model_shape(model: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copy(model / name, dest / name)


def copy_base_tree(commit: str | None, dest: Path) -> None:
    """The tree at ``commit`` into ``dest``, with its short hash in ``dest/BASE_COMMIT``; without
    a commit, no base tree."""
    shutil.rmtree(dest, ignore_errors=True)
    if commit is None:
        return
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    short = subprocess.run(
        ["git", "rev-parse", "--short", commit], check=True, capture_output=True, text=True
    ).stdout
    (dest / "BASE_COMMIT").write_text(short)


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, required=True, help="the converted default model's folder"
    )
    parser.add_argument("--dest", type=Path, default=Path(".gpu-carry"))
    parser.add_argument("--base", help="a commit whose tree the graphs step times first")
    args = parser.parse_args()
    wheels = download_wheels(args.dest / "wheels")
    problems = unmet_requirements(wheels)
    for problem in problems:
        print(f"gpu-carry: {problem}", file=sys.stderr)
    if problems:
        return 1
    copy_model_shape(args.model, args.dest / args.model.name)
    copy_base_tree(args.base, args.dest / "base")
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"{args.dest}: {len(wheels)} wheels, {size_of(args.dest) / 2**20:.1f} MiB in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
