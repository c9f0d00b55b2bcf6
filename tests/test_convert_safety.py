"""`fmoe-convert` and `load_model` lose nothing and leave nothing behind (issue 14).

`--overwrite` deletes only what fmoe-convert wrote; a write that fails (disk full, permission denied, a file
size limit hit inside tensorstore) ends in one line and exit status 1; Ctrl-C pressed twice still removes
the work directory; `load_model` refuses a converted checkpoint whose files changed since conversion.
Sources are random tiny checkpoints written without torch (`write_random_checkpoint`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fmoe_jax.convert import cli
from fmoe_jax.convert.cli import main

import fmoe_jax as fj
from fmoe_jax.checkpoint import orbax_io
from fmoe_jax.checkpoint.hf import CheckpointError
from fmoe_jax.checkpoint.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from fmoe_jax.testing import PRESETS, write_random_checkpoint

TINY = dict(
    PRESETS["tiny-mixtral"], vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2
)
INTERRUPTED = "fmoe-convert: interrupted; nothing was written"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("hf") / "tiny", TINY)


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "tiny"
    assert main([str(hf_dir), str(out), "--quiet"]) == 0
    return out


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry below `directory`: file contents, link targets, and directories (as "<dir>")."""
    out: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        key = path.relative_to(directory).as_posix()
        if path.is_symlink():
            out[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            out[key] = "<dir>"
        else:
            out[key] = path.read_bytes()
    return out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def work_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".fmoe-" in p.name)


def edit_manifest(directory: Path, **changes) -> None:
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# --overwrite -------------------------------------------------------------------------------------------


def not_a_checkpoint(out: Path, converted: Path) -> None:
    """The reported case: someone's directory whose only claim is an empty manifest."""
    out.mkdir()
    (out / MANIFEST_NAME).write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "results.csv").write_text("1,2\n")


def manifest_not_json(out: Path, converted: Path) -> None:
    shutil.copytree(converted, out)
    (out / MANIFEST_NAME).write_text('{"format": "fmoe-jax-orbax", ')


def future_format(out: Path, converted: Path) -> None:
    shutil.copytree(converted, out)
    edit_manifest(out, format_version=99)


def unlisted_file(out: Path, converted: Path) -> None:
    shutil.copytree(converted, out)
    (out / "dense" / "my_notes.txt").write_text("mine")


def unlisted_link(out: Path, converted: Path) -> None:
    shutil.copytree(converted, out)
    (out.parent / "elsewhere").mkdir()
    (out.parent / "elsewhere" / "kept.txt").write_text("mine")
    (out / "shortcut").symlink_to(out.parent / "elsewhere", target_is_directory=True)


@pytest.mark.parametrize(
    "make, reason",
    [
        (not_a_checkpoint, "not an fmoe-jax manifest (format None"),
        (manifest_not_json, "corrupt manifest"),
        (future_format, f"format version 99, this fmoe-convert writes versions 1 to {FORMAT_VERSION}"),
        (unlisted_file, "holds files its fmoe_manifest.json does not list: dense/my_notes.txt"),
        (unlisted_link, "holds files its fmoe_manifest.json does not list: shortcut"),
    ],
    ids=["empty_manifest", "manifest_not_json", "future_format", "unlisted_file", "unlisted_link"],
)
def test_overwrite_refuses_what_fmoe_convert_did_not_write(make, reason, hf_dir, converted, tmp_path, capsys):
    out = tmp_path / "out"
    make(out, converted)
    before, outside = snapshot(out), snapshot(tmp_path)
    rc = main([str(hf_dir), str(out), "--quiet", "--overwrite"])
    err = one_error_line(capsys)
    assert rc == 1
    assert err.startswith(f"fmoe-convert: error: {out}: not replaced: ") and reason in err, err
    assert "--overwrite replaces only a checkpoint written by fmoe-convert" in err
    assert snapshot(out) == before and snapshot(tmp_path) == outside
    assert work_dirs(tmp_path) == []


def test_overwrite_replaces_a_checkpoint_of_an_older_format_version(hf_dir, converted, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    edit_manifest(out, format_version=1)
    assert main([str(hf_dir), str(out), "--quiet", "--overwrite"]) == 0
    assert Manifest.read(out).format_version == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_files_added_while_converting_stop_the_swap(hf_dir, converted, tmp_path):
    """The check runs again just before the old checkpoint is swapped out."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)

    def poll() -> None:
        (out / "late.txt").write_text("written while fmoe-convert ran")

    with pytest.raises(cli.ConvertError, match="does not list: late.txt"):
        cli.convert(hf_dir, out, overwrite=True, poll=poll)
    assert (out / "late.txt").read_text() == "written while fmoe-convert ran"
    assert snapshot(out) == {**snapshot(converted), "late.txt": b"written while fmoe-convert ran"}
    assert work_dirs(tmp_path) == []


# Failures while writing ----------------------------------------------------------------------------------


class FailingWriter:
    """Stands in for orbax's checkpointer: fails the second item the way tensorstore does (a ValueError
    whose kilobytes-long message ends with the OS error code)."""

    def __init__(self, code: int):
        self.code, self.saved = code, 0

    def save(self, path, args) -> None:
        self.saved += 1
        if self.saved == 2:
            spec = json.dumps({"driver": "zarr3", "kvstore": {"path": str(path)}, "padding": "x" * 2000})
            raise ValueError(
                f'RESOURCE_EXHAUSTED: Error writing "c/0/0" in OCDBT database at local file "{path}": '
                f"Failed to write 316 bytes to file 14: {os.strerror(self.code)} "
                f"[tensorstore_spec='{spec}'] [os_error_code='{self.code}']"
            )
        path.mkdir()
        (path / "data").write_bytes(b"\0" * 64)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES], ids=["disk_full", "permission_denied"])
def test_write_failure_is_one_line_and_loses_the_old_checkpoint_not(
    code, hf_dir, converted, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    before = snapshot(out)
    monkeypatch.setattr(orbax_io, "_writer", lambda: FailingWriter(code))
    rc = main([str(hf_dir), str(out), "--quiet", "--overwrite"])
    assert rc == 1
    assert one_error_line(capsys) == (
        f"fmoe-convert: error: {out}: cannot write the checkpoint: {os.strerror(code)} "
        "(writing dense_layer_000)"
    )
    assert snapshot(out) == before and work_dirs(tmp_path) == []


def test_work_directory_that_cannot_be_removed_is_named(hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(orbax_io, "_writer", lambda: FailingWriter(errno.ENOSPC))
    monkeypatch.setattr(cli, "remove_tree", lambda path: False)
    out = tmp_path / "out"
    rc = main([str(hf_dir), str(out), "--quiet"])
    left = tmp_path / f".out.fmoe-tmp-{os.getpid()}"
    try:
        assert rc == 1
        assert one_error_line(capsys).endswith(
            f"No space left on device (writing dense_layer_000); its work directory {left} could not be "
            "removed: delete it yourself"
        )
        assert left.is_dir() and not out.exists()
    finally:
        shutil.rmtree(left)


def test_file_size_limit_inside_tensorstore_is_one_line(hf_dir, tmp_path):
    """A real failure of orbax's and tensorstore's writer threads (RLIMIT_FSIZE: writes past 4 KiB fail with
    EFBIG, as writes to a full disk fail with ENOSPC): one line on stderr, no log lines, no tracebacks."""
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "-c", 'ulimit -f 4 && exec "$0" "$@"', sys.executable, "-m", "fmoe_jax.convert"]
        + [str(hf_dir), str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (
        f"fmoe-convert: error: {out}: cannot write the checkpoint: {os.strerror(errno.EFBIG)} "
        "(writing dense)\n"
    )
    assert list(tmp_path.iterdir()) == []


# Ctrl-C ------------------------------------------------------------------------------------------------


def converting(src: Path, out: Path, *flags: str) -> subprocess.Popen:
    """`fmoe-convert SRC OUT` in a subprocess, returned once it has started writing experts (stderr piped,
    and stdout unless --quiet)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fmoe_jax.convert", str(src), str(out), *flags],
        stdout=None if "--quiet" in flags else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(f".{out.name}.fmoe-tmp-*/experts_layer_000")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.002)
    return proc


def test_signal_handler_never_raises():
    """Signals are only recorded; the stop is raised by `poll`, at a safe point of fmoe-convert's own code."""
    signals = cli._Signals()
    signals.poll()  # nothing received: returns
    for _ in range(3):
        signals._handle(signal.SIGINT, None)
    assert signals.received == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        signals.poll()
    signals.finished = True  # the outcome is being reported: nothing more to stop
    signals._handle(signal.SIGTERM, None)
    signals.poll()


def test_ctrl_c_says_when_it_takes_effect(tmp_path):
    """Without --quiet, the first Ctrl-C is acknowledged at once on stderr, then the run ends interrupted."""
    src = write_random_checkpoint(tmp_path / "hf", dict(TINY, num_hidden_layers=24))
    proc = converting(src, tmp_path / "out")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert out == ""
    assert err.split() == "fmoe-convert: stopping after the item being written".split() + INTERRUPTED.split()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


@pytest.mark.parametrize("second_after_s", [0.0, 0.01, "every 2 ms for 1 s"])
def test_ctrl_c_twice_leaves_nothing(second_after_s, tmp_path):
    """Every SIGINT asks to stop at the next safe point and the handler never raises, so a second one,
    wherever it lands (inside orbax's save, during the cleanup), neither changes the outcome nor leaves the
    work directory. Raising from the handler once hung the process and once ended it in "release unlocked
    lock" (stop 41)."""
    root = tmp_path
    src = write_random_checkpoint(root / "hf", dict(TINY, num_hidden_layers=24))  # ~50 items: seconds
    proc = converting(src, root / "out", "--quiet")
    proc.send_signal(signal.SIGINT)
    if isinstance(second_after_s, float):
        time.sleep(second_after_s)
        proc.send_signal(signal.SIGINT)
    else:
        until = time.monotonic() + 1.0
        while time.monotonic() < until and proc.poll() is None:
            time.sleep(0.002)
            proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # 130 from main; a SIGINT that lands after main returned, while the interpreter shuts down, ends the
    # process by the signal instead (the shell shows 130 for both). The cleanup is done by then.
    assert proc.returncode in (130, -signal.SIGINT), err
    assert err.strip() == INTERRUPTED
    assert sorted(p.name for p in root.iterdir()) == ["hf"]


# load_model --------------------------------------------------------------------------------------------


def damaged_copy(converted: Path, tmp_path: Path, damage: str) -> tuple[Path, str]:
    out = tmp_path / "ckpt"
    shutil.copytree(converted, out)
    manifest = Manifest.read(out)
    name = max(manifest.files, key=lambda n: manifest.files[n].size)  # an array data file
    target = out / name
    if damage == "truncated":
        with open(target, "r+b") as f:
            f.truncate(manifest.files[name].size - 100)
    elif damage == "missing":
        target.unlink()
    elif damage == "altered":  # same size: only the hashes tell
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "config grew":
        name = "config.json"
        (out / name).write_text((out / name).read_text() + "\n")
    return out, name


@pytest.mark.parametrize("damage", ["truncated", "missing", "config grew"])
def test_load_model_refuses_files_that_changed_size(damage, converted, tmp_path):
    out, name = damaged_copy(converted, tmp_path, damage)
    with pytest.raises(CheckpointError) as info:
        fj.load_model(out)
    message = str(info.value)
    assert (
        message.startswith(f"{out / name}: ") and "the checkpoint changed since it was converted" in message
    )
    assert ("missing" if damage == "missing" else "the manifest says") in message


def test_load_model_verify_compares_hashes(converted, tmp_path):
    with fj.load_model(converted, verify=True) as model:  # an intact checkpoint passes
        assert model.config.num_layers == TINY["num_hidden_layers"]
    out, name = damaged_copy(converted, tmp_path, "altered")
    with pytest.raises(CheckpointError, match="sha256 .* differs from the manifest's") as info:
        fj.load_model(out, verify=True)
    assert str(info.value).startswith(f"{out / name}: ")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"fmoe-convert {fj.__version__} (writes checkpoint format fmoe-jax-orbax {FORMAT_VERSION})"
    )
