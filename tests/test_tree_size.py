"""What travels with the checkout (``eval/records/tree_size.py``, ``scripts/tree_size.py``): tracked files and
untracked ones git does not ignore are counted, ignored ones are not, and the check fails above its limit; the
checkout itself is under the 56 MiB limit."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eval.records.tree_size import LIMIT, check, travelling_files

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _repo(tmp_path: Path) -> Path:
    """A git repository with a tracked file of 1,000 bytes, an untracked one of 300 and an ignored venv of 5,000."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tracked.bin").write_bytes(b"x" * 1000)
    (tmp_path / ".gitignore").write_text(".venv/\n")  # 7 bytes, itself untracked and not ignored
    subprocess.run([*git, "add", "tracked.bin"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one file"], cwd=tmp_path, check=True)
    (tmp_path / "untracked.txt").write_bytes(b"y" * 300)
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "big.so").write_bytes(b"z" * 5000)
    return tmp_path


def test_tracked_and_untracked_files_count_and_ignored_ones_do_not(tmp_path):
    repo = _repo(tmp_path)
    assert travelling_files(repo) == {"tracked.bin": 1000, "untracked.txt": 300, ".gitignore": 7}
    (repo / "tracked.bin").unlink()  # deleted from the working tree: nothing travels
    assert travelling_files(repo) == {"untracked.txt": 300, ".gitignore": 7}


def test_the_check_fails_above_its_limit_and_passes_at_or_below_it(tmp_path):
    repo = _repo(tmp_path)
    ok, lines = check(repo, limit=1306)
    assert not ok and lines[0].startswith("TOO LARGE: 1,307 bytes") and "tracked.bin" in lines[2]
    assert check(repo, limit=1307)[0]
    script = [sys.executable, str(ROOT / "scripts" / "tree_size.py"), str(repo)]
    above = subprocess.run([*script, "--limit", "1000"], capture_output=True, text=True)
    below = subprocess.run([*script, "--limit", "10000"], capture_output=True, text=True)
    assert above.returncode == 1 and "TOO LARGE" in above.stdout and "untracked.txt" in above.stdout
    assert below.returncode == 0 and below.stdout.startswith("ok: 1,307 bytes")


def test_the_checkout_is_under_the_limit():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ok, lines = check(ROOT, LIMIT)
    assert ok, "\n".join(lines)
