"""CI's `--dist loadgroup` keeps an xdist_group on one worker (conftest.py's _keep_xdist_groups): the real
checkpoints' tests must not hold two of their models in memory at once, and a group's module-scoped fixture
(test_bench_serving's benchmark run) must run once, not once per worker."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("root_conftest", {str(ROOT / "conftest.py")!r})
root = importlib.util.module_from_spec(spec)
spec.loader.exec_module(root)

pytest_collection_modifyitems = root.pytest_collection_modifyitems
'''
GROUPED = '''
import pytest
pytestmark = pytest.mark.xdist_group("together")

@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    pass

def test_plain_name():
    pass
'''
LOOSE = '''
import pytest

@pytest.mark.parametrize("i", range(6))
def test_loose(i):
    pass
'''


def test_loadgroup_runs_every_test_of_a_group_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_loose.py").write_text(LOOSE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                          "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    ran = re.findall(r"\[(gw\d)\] .*PASSED (\S+)", run.stdout)
    grouped = {worker for worker, test in ran if "test_grouped.py" in test}
    assert len([t for _, t in ran if "test_grouped.py" in t]) == 7 and all(
        t.endswith("@together") for _, t in ran if "test_grouped.py" in t), run.stdout
    assert len(grouped) == 1, f"the group ran on {sorted(grouped)}:\n{run.stdout}"
    assert not any("@" in t for _, t in ran if "test_loose.py" in t), run.stdout
