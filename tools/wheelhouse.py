"""Build the wheels pretrain needs on a machine without an index that already has torch (tools/install.sh --wheelhouse).

Run on a machine with an index, by any Python that has pip (DeepSpeed's wheel is built by this Python without its
ops, so it is pure Python and fits any target). The target (Python version, platform) may differ from this
machine: pip resolves pretrain and the extras for it (wheels only, metadata only), and the wheels are downloaded
for it. torch is left out, and so is whatever only torch needs (its CUDA libraries, sympy, ...) and triton (torch's
compiler; a CUDA torch pins its own): the target's torch build is the one that matches its driver, and the offline
install pins it (tools/install.sh --offline).

    python tools/wheelhouse.py DIR [--python 3.12] [--platform manylinux_2_28_x86_64] [--extras all] [--have FILE]

``--have FILE``: what the target already has, as ``pip list --format=freeze`` prints it there (``name==version``
lines; a bare ``name`` line: there at a version taken to do, which the offline install then checks). A package
it has at a version that meets what asks for it is left out, with what only it needs: a cluster image with
accelerate, transformers, numpy, ... then needs a few MiB of wheels instead of 170.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TORCH_STACK = {"torch", "triton"}  # never from the wheelhouse: the target's torch build owns them


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def platform_tags(platform: str) -> list[str]:
    """``platform`` and every older tag a machine of that platform runs: pip matches the tags it is given
    literally, and most wheels are tagged for an older glibc (manylinux_2_17 = manylinux2014) than the target's."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(glibc, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_{arch}")
    return tags


def target_args(python: str | None, platform: str | None) -> list[str]:
    out = ["--only-binary=:all:"]
    if python:
        out += ["--python-version", python]
    for tag in platform_tags(platform) if platform else []:
        out += ["--platform", tag]
    return out


def resolve(extras: str, wheelhouse: Path, target: list[str]) -> dict:
    """pip's installation report for pretrain[extras] on the target, as if nothing were installed."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pip("install", "--quiet", "--dry-run", "--ignore-installed", "--target", str(Path(scratch) / "t"),
            "--find-links", str(wheelhouse), *target, "--report", str(report), f"pretrain[{extras}]")
        return json.loads(report.read_text())


def read_have(path: Path | None) -> dict[str, str | None]:
    """{name: version, or None for a bare name} from a ``pip list --format=freeze`` file (comments and other
    lines, e.g. ``-e`` ones, are skipped)."""
    if path is None:
        return {}
    have: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        name, sep, version = line.partition("==")
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()) and (not sep or version.strip()):
            have[canonicalize_name(name)] = version.strip() if sep else None
    return have


def needed_without_torch(report: dict, python: str | None, have: dict[str, str | None] | None = None
                         ) -> dict[str, str]:
    """{name: version} of what pretrain[extras] reaches without going through torch's stack, nor through a
    package the target already ``have``s at a version that meets the requirement."""
    have = have or {}
    env = dict(report.get("environment") or default_environment())
    if python:  # the report's markers are this interpreter's; the target's Python decides python_version
        env["python_version"] = python
        env["python_full_version"] = python + ".0"
    items = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    keep: dict[str, str] = {}
    todo = [("pretrain", set(items["pretrain"].get("requested_extras") or []))]
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extras = todo.pop()
        if name in TORCH_STACK or name not in items:
            continue
        keep[name] = items[name]["metadata"]["version"]
        for spec in items[name]["metadata"].get("requires_dist") or []:
            req = Requirement(spec)
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e})
                                                  for e in (extras or {""})):
                continue
            dep = canonicalize_name(req.name)
            if dep in have and (have[dep] is None or req.specifier.contains(have[dep], prereleases=True)):
                continue  # on the target already, at a version that will do
            # pretrain[all] names pretrain[deepspeed,...]: the same package, more extras.
            key = (dep, ",".join(sorted(req.extras)))
            if key not in seen:
                seen.add(key)
                todo.append((dep, set(req.extras)))
    return keep


def stub_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """An empty wheel with this name, version and requirements: all pip resolves on."""
    # The wheel spec escapes a name in file names (runs of - _ . become _): "py-cpuinfo" is py_cpuinfo-9.0.0-...,
    # which pip would otherwise read as a project named "py" at version "cpuinfo".
    stem = f"{re.sub(r'[-_.]+', '_', name)}-{version}"
    info = f"{stem}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: pretrain\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for member, text in files.items():
            whl.writestr(member, text)
    return path


def check_complete(wheelhouse: Path, extras: str, target: list[str], report: dict,
                   have: dict[str, str | None]) -> None:
    """Resolve pretrain[extras] from the wheelhouse alone, with requirement-free stand-ins for torch's stack and
    what the target ``have``s: a wheel the walk above missed fails here, where there is an index, not on the
    target."""
    with tempfile.TemporaryDirectory() as scratch:
        for item in report["install"]:
            if canonicalize_name(item["metadata"]["name"]) in TORCH_STACK:
                stub_wheel(Path(scratch) / "stubs", item["metadata"]["name"], item["metadata"]["version"])
        resolved = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
        for name, version in have.items():
            if name not in TORCH_STACK and name != "pretrain" and (version or name in resolved):
                stub_wheel(Path(scratch) / "stubs", name, version or resolved[name])
        pip("install", "--quiet", "--dry-run", "--ignore-installed", "--no-index", "--target", str(Path(scratch) / "t"),
            "--find-links", str(wheelhouse), "--find-links", str(Path(scratch) / "stubs"), *target, f"pretrain[{extras}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheelhouse", type=Path)
    parser.add_argument("--python", help="the target's Python version, e.g. 3.12 (default: this one)")
    parser.add_argument("--platform", help="the target's platform tag, e.g. manylinux_2_28_x86_64 (default: this one)")
    parser.add_argument("--extras", default="all", help="pretrain's extras to include (default: all)")
    parser.add_argument("--have", type=Path, help="the target's `pip list --format=freeze`: what it has is left out")
    args = parser.parse_args()
    # pyproject.toml names the extras and their floors (pretrain itself may not be importable on a login node).
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    EXTRAS = sorted(set(optional) - {"all", "dev"})
    unknown = sorted(set(args.extras.split(",")) - {"all", *EXTRAS} - {""})
    if unknown:
        print(f"error: --extras {args.extras}: pretrain has no extra {', '.join(unknown)}; its extras: all, "
              f"{', '.join(EXTRAS)}", file=sys.stderr)
        return 2
    wheelhouse = args.wheelhouse.resolve()
    wheelhouse.mkdir(parents=True, exist_ok=True)
    target = target_args(args.python, args.platform)

    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheelhouse), str(ROOT))
    # DeepSpeed publishes only its source; built without ops (DS_BUILD_OPS=0) it is pure Python and compiles
    # the ops it needs on first use on the target, against the target's torch.
    if {"all", "deepspeed"} & set(args.extras.split(",")):
        os.environ["DS_BUILD_OPS"] = "0"
        pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheelhouse),
            optional["deepspeed"][0])

    report = resolve(args.extras, wheelhouse, target)
    have = read_have(args.have)
    keep = needed_without_torch(report, args.python, have)
    built = {canonicalize_name(p.name.split("-")[0]) for p in wheelhouse.glob("*.whl")}
    todo = sorted(f"{name}=={version}" for name, version in keep.items() if name not in built)
    if todo:
        pip("download", "--quiet", "--no-deps", *target, "--dest", str(wheelhouse), *todo)
    check_complete(wheelhouse, args.extras, target, report, have)
    wheels = sorted(wheelhouse.glob("*.whl"))
    size_mib = sum(p.stat().st_size for p in wheels) / 2**20
    print(f"wheelhouse {wheelhouse}: {len(wheels)} wheels, {size_mib:.0f} MiB (pretrain[{args.extras}] without "
          f"{', '.join(sorted(TORCH_STACK))} and what only torch needs"
          + (f", nor what {args.have} lists" if args.have else "") + ")")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:  # pip has said why
        print(f"error: {' '.join(exc.cmd[2:5])} ... failed (exit {exc.returncode}): see pip's message above; "
              "building a wheelhouse needs the package index", file=sys.stderr)
        sys.exit(1)
