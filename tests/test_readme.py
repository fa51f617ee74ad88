"""The README's commands work as written, in the shell, after its set-up commands: the
Usage snippet saved as usage.py, then every `deepscope` command of the block after it, in a
shell that activated `.venv` the way the README says (here `.venv` is this test's venv)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
VENV = Path(sys.prefix)


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands(block: str) -> list[str]:
    """The block's command lines, comments stripped."""
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (VENV / "bin" / "activate").exists():
        pytest.skip(f"tests do not run in a virtual environment ({sys.prefix})")
    work = tmp_path_factory.mktemp("readme")
    (work / ".venv").symlink_to(VENV, target_is_directory=True)
    return work


def _fresh_shell_env() -> dict[str, str]:
    """This environment with a PATH without the venv: only the activation may put it there."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if Path(p) != VENV / "bin")
    return env


def test_setup_block_says_how_to_put_deepscope_on_path() -> None:
    setup = _commands(_blocks("bash")[0])
    assert setup[:2] == ["make demo", "make test"]
    assert setup[2] == ". .venv/bin/activate"
    assert "make demo PORT=" in README


def test_usage_snippet_and_commands_run_as_written(workdir: Path) -> None:
    activate = _commands(_blocks("bash")[0])[2]
    usage = next(b for b in _blocks("python") if "deepscope.Scope(" in b)
    (workdir / "usage.py").write_text(usage)
    commands = _commands(next(b for b in _blocks("bash") if "python usage.py" in b))
    serve = [c for c in commands if c.startswith("deepscope serve")]
    assert serve == ["deepscope serve runs"]
    others = [c for c in commands if c not in serve]
    assert others[0] == "python usage.py" and len(others) >= 5
    script = "\n".join(["set -e", activate, *others])
    done = subprocess.run(["bash", "-c", script], cwd=workdir, env=_fresh_shell_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "baseline" in done.stdout  # deepscope ls
    assert (workdir / "cockpit.png").stat().st_size > 10_000
    assert list((workdir / "baseline-tables").glob("*.parquet"))
    # serve blocks: start it as written (on any free port), load the page, stop it
    proc = subprocess.Popen(["bash", "-c", f"{activate} && exec {serve[0]} --port 0"],
                            cwd=workdir, stdout=subprocess.PIPE, text=True,
                            env=_fresh_shell_env())
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://\S+/", line)
        assert url, line
        with urllib.request.urlopen(url.group(0), timeout=30) as page:
            assert page.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
