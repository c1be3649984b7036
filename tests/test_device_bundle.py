"""The device bundle's pieces that run without a download: which natives are dropped, jars and
wheels rewritten stored, a bundle packed and unpacked, and wheels installed without pip."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from relaygr.device import bundle as db

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("name", "other"),
    [
        ("linux/amd64/libzstd-jni-1.5.6-10.so", False),
        ("darwin/aarch64/libzstd-jni-1.5.6-10.dylib", True),
        ("win/amd64/libzstd-jni-1.5.6-10.dll", True),
        ("linux/aarch64/libzstd-jni-1.5.6-10.so", True),
        ("org/xerial/snappy/native/Linux/x86_64/libsnappyjava.so", False),
        ("org/xerial/snappy/native/Linux/android-aarch64/libsnappyjava.so", True),
        ("org/xerial/snappy/native/AIX/ppc64/libsnappyjava.a", True),
        ("net/jpountz/util/linux/amd64/liblz4-java.so", False),
        ("net/jpountz/util/win32/amd64/liblz4-java.so", True),
        ("org/apache/kafka/Some.class", False),
    ],
)
def test_only_linux_x86_64_natives_are_kept(name: str, other: bool) -> None:
    assert db.native_for_other_platform(name) is other


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_a_jar_is_rewritten_stored_without_other_platforms_natives(tmp_path: Path) -> None:
    members = {
        "a/B.class": b"x" * 1000,
        "linux/amd64/libz.so": b"elf" * 100,
        "darwin/x86_64/libz.dylib": b"macho" * 100,
    }
    src = _zip(tmp_path / "z.jar", members)
    dropped = db.rezip_stored(src, tmp_path / "out.jar", keep=lambda n: not db.native_for_other_platform(n))
    assert dropped == 1
    with zipfile.ZipFile(tmp_path / "out.jar") as zf:
        assert zf.testzip() is None
        assert {i.filename: i.compress_type for i in zf.infolist()} == {
            "a/B.class": zipfile.ZIP_STORED,
            "linux/amd64/libz.so": zipfile.ZIP_STORED,
        }
        assert zf.read("a/B.class") == members["a/B.class"]


def _wheel(folder: Path, dist: str, module: str) -> Path:
    return _zip(
        folder / f"{dist}-1.0-py3-none-any.whl",
        {f"{module}/__init__.py": b"VALUE = 42\n", f"{dist}-1.0.dist-info/METADATA": b"Name: x\n"},
    )


def test_a_packed_bundle_unpacks_to_the_environment_the_check_reads(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    jars = stage / "jars"
    jars.mkdir(parents=True)
    _zip(jars / "kafka-clients.jar", {"a.class": b"1"})
    (jars / ".complete").write_text(db.KAFKA_VERSION)
    (stage / "jre" / "bin").mkdir(parents=True)
    (stage / "wheels").mkdir()
    _wheel(stage / "wheels", "relaygr_bundle_probe", "relaygr_bundle_probe")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    parts = {
        p: {"file": f"{p}.tar.xz", "bytes": db.pack(stage / p, bundle / f"{p}.tar.xz")} for p in db.PARTS
    }
    (bundle / "bundle.json").write_text(json.dumps({"kafka_version": db.KAFKA_VERSION, "parts": parts}))

    dest = tmp_path / "dest"
    env = db.unpack(bundle, dest)
    assert env == {
        "RELAYGR_WHEELS": str(dest / "wheels"),
        "JAVA_HOME": str(dest / "jre"),
        "RELAYGR_CACHE_DIR": str(dest / "cache"),
    }
    assert (dest / "cache" / f"kafka-{db.KAFKA_VERSION}" / ".complete").exists()
    assert db.unpack(bundle, dest) == env  # a second unpack reuses the first
    lines = db.env_lines(env)
    assert f'export PATH={dest / "jre" / "bin"}:"$PATH"' in lines

    target = tmp_path / "site"
    assert db.install_wheels(dest / "wheels", target) == ["relaygr-bundle-probe"]
    probe = [sys.executable, "-c", "import relaygr_bundle_probe as p; print(p.VALUE)"]
    done = subprocess.run(probe, env={"PYTHONPATH": str(target)}, capture_output=True, text=True)
    assert done.stdout.strip() == "42", done.stderr


def test_wheels_of_what_this_python_has_are_not_installed(tmp_path: Path) -> None:
    _wheel(tmp_path, "pytest", "pytest_shadow")
    assert db.install_wheels(tmp_path, tmp_path / "site") == []


def test_unpack_without_a_bundle_says_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="device-bundle"):
        db.unpack(tmp_path, tmp_path / "dest")


def test_the_bundle_is_ignored_by_git_and_built_by_dev() -> None:
    assert "/.device-bundle/" in (ROOT / ".gitignore").read_text().splitlines()
    dev = (ROOT / "dev").read_text()
    assert "device-bundle) device_bundle" in dev and "device/bundle.py unpack" in dev
