"""The tools' tests' scratch repository: a temporary tree with copies of the repository's check
scripts, files written into it, a check script run on it, and the ok/FAIL lines they print.

    repo = ScratchRepo(["tools/check_paths.py"])
    repo.write("notes/a.md", "...")
    rc, out = repo.run("tools/check_paths.py")
    repo.check(rc == 0, "what passing means")
    sys.exit(repo.finish())
"""
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ScratchRepo:
    def __init__(self, copies):
        self.root = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        self.failures = []
        for rel in copies:
            os.makedirs(os.path.dirname(os.path.join(self.root, rel)), exist_ok=True)
            shutil.copy(os.path.join(REPO, rel), os.path.join(self.root, rel))

    def write(self, rel, text):
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    def run(self, script):
        p = subprocess.run([sys.executable, os.path.join(self.root, script)], capture_output=True,
                           text=True)
        return p.returncode, p.stdout + p.stderr

    def check(self, cond, what):
        print(("ok:   " if cond else "FAIL: ") + what)
        if not cond:
            self.failures.append(what)

    def finish(self):
        """Removes the tree; the exit code: 1 when a check failed."""
        shutil.rmtree(self.root, ignore_errors=True)
        print("%d check(s) failed" % len(self.failures) if self.failures else "all checks passed")
        return 1 if self.failures else 0
