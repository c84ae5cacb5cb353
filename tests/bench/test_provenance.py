"""The source digest a result file carries: the same files give the same digest, any change to
a file's bytes or name changes it, and caches are left out."""

import subprocess

from ringflow._bench.provenance import provenance, source_digest


def _tree(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_same_files_same_digest(tmp_path):
    files = {"a.py": "x = 1\n", "sub/b.py": "y = 2\n"}
    one = _tree(tmp_path / "one", files)
    two = _tree(tmp_path / "two", files)
    assert source_digest(one) == source_digest(two)
    assert len(source_digest(one)) == 16


def test_a_changed_byte_or_name_changes_it(tmp_path):
    root = _tree(tmp_path, {"a.py": "x = 1\n", "sub/b.py": "y = 2\n"})
    before = source_digest(root)
    (root / "a.py").write_text("x = 2\n")
    assert source_digest(root) != before
    (root / "a.py").write_text("x = 1\n")
    assert source_digest(root) == before
    (root / "sub/b.py").rename(root / "sub/c.py")
    assert source_digest(root) != before


def test_caches_and_other_files_left_out(tmp_path):
    root = _tree(tmp_path, {"a.py": "x = 1\n"})
    before = source_digest(root)
    _tree(root, {"__pycache__/a.py": "junk", "notes.txt": "junk"})
    assert source_digest(root) == before


def test_git_commit_and_dirty_flag(tmp_path):
    root = _tree(tmp_path, {"a.py": "x = 1\n"})
    assert provenance(root)["git_commit"] is None  # not a checkout
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    subprocess.run([*git, "add", "."], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=root, check=True)
    p = provenance(root)
    assert len(p["git_commit"]) == 40 and p["git_dirty"] is False
    (root / "a.py").write_text("x = 3\n")
    assert provenance(root)["git_dirty"] is True
    assert provenance(root)["source_digest"] != p["source_digest"]
