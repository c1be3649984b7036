"""The device bundle: what the device check needs on a bare accelerator machine, built here.

An accelerator machine may have torch but no Java, no network and none of the pipeline's Python
packages. ``python3 device/bundle.py build DIR`` (``./dev device-bundle``) writes three
xz-compressed tars into ``DIR`` and a ``bundle.json`` that lists them:

- ``wheels.tar.xz``: CPython 3.12 manylinux x86-64 wheels of what the check imports that such a
  machine lacks (``WHEEL_REQUIREMENTS``, at the versions ``pyproject.toml`` allows, with their
  dependencies; recbole without its dependencies: only its MovieLens files are read);
- ``jre.tar.xz``: a Java runtime cut from this machine's JDK with ``jlink`` (``JRE_MODULES``);
- ``jars.tar.xz``: the broker's jars (``~/.cache/relaygr/kafka-<version>``).

Zip archives (wheels, jars) are stored uncompressed inside the tar so that xz compresses the
whole (it does far better than each member's deflate), and the jars lose the native libraries of
other platforms than Linux x86-64. ``python3 device/bundle.py unpack DIR DEST`` lays the
bundle out in ``DEST`` (``wheels/``, ``jre/``, ``cache/kafka-<version>/``) and prints the shell
assignments that point the check at it (``JAVA_HOME``, ``PATH``, ``RELAYGR_CACHE_DIR``,
``RELAYGR_WHEELS``); ``install WHEELS TARGET`` unpacks the wheels whose distribution the running
Python lacks into ``TARGET`` (no pip needed). Standard library only: it runs with any Python 3.11+.

Primitives: ``native_for_other_platform(name)``, ``rezip_stored(src, dst, keep)``,
``build_wheels``, ``build_jre``, ``build_jars``, ``pack``, ``build``, ``unpack``, ``env_lines``,
``install_wheels``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import itertools
import json
import lzma
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

KAFKA_VERSION = "4.1.2"
WHEEL_REQUIREMENTS = (
    "pydantic>=2.7,<3",
    "pydantic-settings>=2.3,<3",
    "rocksdict>=0.3.25,<0.4",
    "aiokafka>=0.14,<0.15",
    "faust-streaming>=0.15.3,<0.16",
)
DATA_ONLY_WHEELS = ("recbole==1.2.1",)
"""Only MovieLens-100K's files are read from it (``workers.training.movielens``): the rest of the
wheel is left out (``DATA_ONLY_KEEP``), and its dependencies are never fetched."""
DATA_ONLY_KEEP = ("recbole/__init__.py", "recbole/dataset_example/ml-100k/", ".dist-info/")
ON_THE_DEVICE = ("packaging", "six", "python_dateutil", "attrs", "sortedcontainers")
"""Dependencies the device has already, as hard dependencies of what it has (pytest, matplotlib,
hypothesis): left out of the bundle. typing_extensions stays: torch's may be older than the one
pydantic-core needs (``Sentinel``), and a newer one is installed over it."""
WHEEL_TARGET = {
    "python_version": "3.12",
    "implementation": "cp",
    "platforms": ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"),
}
JRE_MODULES = (
    "java.base",
    "java.desktop",  # java.beans: the storage tool fails without it (PropertyChangeEvent)
    "java.logging",
    "java.management",
    "java.naming",
    "java.security.jgss",
    "java.security.sasl",
    "java.sql",
    "java.xml",
    "jdk.crypto.ec",
    "jdk.management",
    "jdk.unsupported",
    "jdk.zipfs",
)
"""The modules the broker starts (KRaft, the storage tool) and serves with: fewer than a full JRE."""
JRE_UNUSED_NATIVES = ("libawt", "libmlib_image", "libjsound", "libfontmanager", "libsplashscreen",
                      "libjavajpeg", "liblcms")  # fmt: skip
"""java.desktop's natives (AWT, imaging, sound, fonts): the broker runs headless and only needs
the module's java.beans classes."""
NATIVE_SUFFIXES = (".so", ".dll", ".dylib", ".jnilib", ".a")
PARTS = ("wheels", "jre", "jars")
XZ_PRESET = 9 | lzma.PRESET_EXTREME
MAX_BUNDLE_BYTES = 40 * 10**6
"""The device run carries 64 MiB in all, the checkout included."""


def native_for_other_platform(name: str) -> bool:
    """Whether a zip member is a native library for another platform than Linux x86-64 (the
    layouts of zstd-jni ``linux/amd64``, snappy-java ``Linux/x86_64`` and lz4-java)."""
    if not name.lower().endswith(NATIVE_SUFFIXES):
        return False
    parts = [p.lower() for p in name.split("/")[:-1]]
    return not ("linux" in parts and ("amd64" in parts or "x86_64" in parts))


def _stripped(data: bytes, strip: str) -> bytes:
    """A shared library without its symbol tables and debug sections (``strip --strip-unneeded``
    keeps what the dynamic linker needs)."""
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        if subprocess.run([strip, "--strip-unneeded", f.name], capture_output=True).returncode != 0:
            return data  # not an ELF file strip knows: kept as it is
        return Path(f.name).read_bytes()


def rezip_stored(
    src: Path, dst: Path, keep: Callable[[str], bool] = lambda _: True, *, strip: str | None = None
) -> int:
    """``src`` rewritten to ``dst`` with every member stored uncompressed (members for which
    ``keep`` is false left out; with ``strip``, the path of ``strip``, shared libraries stripped);
    returns how many were left out."""
    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if not keep(info.filename):
                dropped += 1
                continue
            data = zin.read(info)  # before the member's info is changed to stored
            if strip and info.filename.endswith(".so"):
                data = _stripped(data, strip)
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
    return dropped


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"device-bundle: {' '.join(cmd[:4])} ... failed:\n{tail}")


def _pip_download(dest: Path, requirements: tuple[str, ...], *, deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(dest)]
    cmd += [
        "--python-version",
        WHEEL_TARGET["python_version"],
        "--implementation",
        WHEEL_TARGET["implementation"],
    ]
    for platform in WHEEL_TARGET["platforms"]:
        cmd += ["--platform", platform]
    _run(cmd + ([] if deps else ["--no-deps"]) + list(requirements))


def _data_only_member(name: str) -> bool:
    return name.startswith(DATA_ONLY_KEEP[:2]) or DATA_ONLY_KEEP[2] in name.split("/")[0] + "/"


def build_wheels(stage: Path) -> dict:
    """The wheels, downloaded into a scratch folder and rewritten stored into ``stage``."""
    with tempfile.TemporaryDirectory() as tmp:
        got = Path(tmp)
        _pip_download(got, WHEEL_REQUIREMENTS, deps=True)
        _pip_download(got, DATA_ONLY_WHEELS, deps=False)
        stage.mkdir(parents=True)
        names = sorted(p.name for p in got.glob("*.whl") if p.name.split("-")[0] not in ON_THE_DEVICE)
        data_only = {r.split("==")[0] for r in DATA_ONLY_WHEELS}
        for name in names:
            keep = _data_only_member if name.split("-")[0] in data_only else (lambda _: True)
            # The extensions' symbol tables (Cython's: 13 MB of 48) go; a wheel's RECORD hashes are
            # not checked by the installer here.
            rezip_stored(got / name, stage / name, keep, strip=shutil.which("strip"))
    return {"wheels": names, **{k: v for k, v in WHEEL_TARGET.items() if k != "platforms"}}


def build_jre(stage: Path) -> dict:
    """A runtime of ``JRE_MODULES`` cut with this machine's ``jlink``."""
    jlink = shutil.which("jlink")
    if jlink is None:
        raise SystemExit(
            "device-bundle: jlink not found: install a JDK 17+ (apt-get install openjdk-17-jdk-headless)"
        )
    _run([jlink, "--add-modules", ",".join(JRE_MODULES), "--strip-debug", "--no-man-pages",
          "--no-header-files", "--compress=0", "--output", str(stage)])  # fmt: skip
    for lib in (stage / "lib").glob("*.so"):
        if lib.name.startswith(JRE_UNUSED_NATIVES):
            lib.unlink()
    strip = shutil.which("strip")
    if strip:  # the native libraries' symbol tables (libjvm.so: 24 MB -> 20 MB)
        for lib in (stage / "lib").rglob("*.so"):
            _run([strip, "--strip-unneeded", str(lib)])
    release = (stage / "release").read_text() if (stage / "release").exists() else ""
    version = next((line.split("=", 1)[1].strip('"') for line in release.splitlines()
                    if line.startswith("JAVA_VERSION=")), None)  # fmt: skip
    return {"modules": list(JRE_MODULES), "java_version": version}


def jars_source(kafka_version: str = KAFKA_VERSION) -> Path:
    cache = os.environ.get("RELAYGR_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "relaygr"
    )
    return Path(cache) / f"kafka-{kafka_version}"


def build_jars(stage: Path, source: Path) -> dict:
    """The broker's jars from ``source``, stored, without other platforms' natives."""
    if not (source / ".complete").exists():
        raise SystemExit(
            f"device-bundle: no broker jars in {source}: run `relaygr broker fetch` (or ./dev setup)"
        )
    stage.mkdir(parents=True)
    dropped = 0
    jars = sorted(source.glob("*.jar"))
    for jar in jars:
        dropped += rezip_stored(jar, stage / jar.name, keep=lambda n: not native_for_other_platform(n))
    shutil.copy(source / ".complete", stage / ".complete")
    return {
        "jars": len(jars),
        "natives_dropped": dropped,
        "source_bytes": sum(j.stat().st_size for j in jars),
    }


def pack(folder: Path, out: Path) -> int:
    """``folder`` as ``out`` (tar.xz, members under the folder's name); returns its bytes."""
    with lzma.open(out, "wb", preset=XZ_PRESET) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(folder, arcname=folder.name)
    return out.stat().st_size


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def build(out: Path, parts: tuple[str, ...] = PARTS, kafka_version: str = KAFKA_VERSION) -> dict:
    """Every part of ``parts`` as ``<part>.tar.xz`` in ``out``, and ``bundle.json``."""
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"kafka_version": kafka_version, "parts": {}}
    if (out / "bundle.json").exists():
        manifest = json.loads((out / "bundle.json").read_text()) | {"kafka_version": kafka_version}
    with tempfile.TemporaryDirectory() as tmp:
        for part in parts:
            stage = Path(tmp) / part
            facts = {
                "wheels": lambda s=stage: build_wheels(s),
                "jre": lambda s=stage: build_jre(s),
                "jars": lambda s=stage: build_jars(s, jars_source(kafka_version)),
            }[part]()
            unpacked = _tree_bytes(stage)
            size = pack(stage, out / f"{part}.tar.xz")
            manifest["parts"][part] = {
                "file": f"{part}.tar.xz",
                "bytes": size,
                "unpacked_bytes": unpacked,
                **facts,
            }
            print(f"{part}.tar.xz: {size / 1e6:.1f} MB ({unpacked / 1e6:.1f} MB unpacked)", file=sys.stderr)
    manifest["total_bytes"] = sum(p["bytes"] for p in manifest["parts"].values())
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def unpack(bundle: Path, dest: Path) -> dict[str, str]:
    """The bundle's parts laid out in ``dest``; returns the environment that points at them."""
    manifest_file = bundle / "bundle.json"
    if not manifest_file.exists():
        raise SystemExit(f"device-bundle: {bundle} holds no bundle.json (build one with ./dev device-bundle)")
    manifest = json.loads(manifest_file.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    env: dict[str, str] = {}
    for part, facts in manifest["parts"].items():
        if not (dest / part).exists():
            with tarfile.open(bundle / facts["file"], "r:xz") as tar:
                tar.extractall(dest, filter="tar")
        if part == "jre":
            env["JAVA_HOME"] = str(dest / "jre")
        elif part == "jars":
            cache = dest / "cache"
            jars = cache / f"kafka-{manifest['kafka_version']}"
            if not jars.exists():
                cache.mkdir(exist_ok=True)
                (dest / "jars").rename(jars)
            env["RELAYGR_CACHE_DIR"] = str(cache)
        elif part == "wheels":
            env["RELAYGR_WHEELS"] = str(dest / "wheels")
    return env


def _dist_name(wheel: str) -> str:
    """A wheel file's distribution, normalised as ``importlib.metadata`` finds it."""
    return wheel.split("-", 1)[0].lower().replace("_", "-").replace(".", "-")


def _version_key(version: str) -> tuple[int, ...]:
    """The leading numbers of a version (``4.16.0`` -> ``(4, 16, 0)``; ``2.0rc1`` -> ``(2, 0)``)."""
    out = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    return tuple(out)


def installed_here(dist: str, at_least: str = "0") -> bool:
    """Whether this Python has ``dist`` at version ``at_least`` or newer."""
    try:
        have = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return _version_key(have) >= _version_key(at_least)


def install_wheels(wheels: Path, target: Path) -> list[str]:
    """Every wheel in ``wheels`` whose distribution this Python lacks (or has older), unpacked into ``target``
    (what ``pip install --target --no-deps`` does for these wheels, without needing pip: a wheel's
    ``.data/purelib`` and ``.data/platlib`` go to the top, its scripts and headers are left out).
    Returns the distributions installed."""
    target.mkdir(parents=True, exist_ok=True)
    done = []
    for wheel in sorted(wheels.glob("*.whl")):
        dist = _dist_name(wheel.name)
        if installed_here(dist, wheel.name.split("-")[1]):
            continue
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    info.filename = "/".join(parts[2:])
                if info.filename:
                    zf.extract(info, target)
        done.append(dist)
    importlib.invalidate_caches()
    return done


def env_lines(env: dict[str, str]) -> list[str]:
    """Shell assignments of ``env`` (``JAVA_HOME`` also puts its ``bin`` first on ``PATH``)."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    if "JAVA_HOME" in env:
        lines.append(f'export PATH={shlex.quote(env["JAVA_HOME"] + "/bin")}:"$PATH"')
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the bundle into DIR")
    b.add_argument("dir", type=Path)
    b.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    u = sub.add_parser("unpack", help="lay DIR's bundle out in DEST; print the shell assignments")
    u.add_argument("dir", type=Path)
    u.add_argument("dest", type=Path)
    i = sub.add_parser("install", help="unpack the wheels of WHEELS this Python lacks into TARGET")
    i.add_argument("wheels", type=Path)
    i.add_argument("target", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "install":
        print(" ".join(install_wheels(args.wheels, args.target)))
        return 0
    if args.cmd == "unpack":
        print("\n".join(env_lines(unpack(args.dir, args.dest))))
        return 0
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; use some of {','.join(PARTS)}")
    manifest = build(args.dir, parts)
    total = manifest["total_bytes"]
    print(
        f"bundle in {args.dir}: {total / 1e6:.1f} MB in all (limit {MAX_BUNDLE_BYTES / 1e6:.0f} MB)",
        file=sys.stderr,
    )
    return 0 if total <= MAX_BUNDLE_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
