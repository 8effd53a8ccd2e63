"""Build the reference environment: `make reference-envs` runs this with .venv's python.

    .venv/bin/python tests/reference/build_env.py [--env .venv-reference] [--requirements FILE]

PyLate and FlagEmbedding, the libraries that judge the ColBERT and BGE-M3 outputs, pin versions of
sentence-transformers and transformers that .venv cannot hold (tests/reference/requirements.txt says
which). They get a virtual environment of their own, built here from that file's exact pins with
`pip install --no-deps` (the file is the whole closure). torch is not downloaded again: the running
interpreter's torch (.venv's, the CPU build) is linked in, its distribution's top-level entries as
relative symlinks in `shared-torch/`, which a .pth file puts on the environment's path, so nothing else of
.venv leaks in. A finished build writes the stamp file last; a failed one exits 1 with one line naming
the step that failed and the log to read.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements.txt")
DEFAULT_ENV = ROOT / ".venv-reference"
STAMP_NAME = ".built-stamp"  # the Makefile's target and tests/reference_env.py's check
# what the environment must import and at which versions once built (the libraries the runner calls)
CHECK = (
    "import importlib.metadata as m, torch, pylate.models, pylate.rank, FlagEmbedding;"
    "print(' '.join(f'{n}=={m.version(n)}' for n in"
    " ('torch', 'transformers', 'sentence-transformers', 'pylate', 'FlagEmbedding')))"
)


class BuildError(Exception):
    """A step that failed: its message is the one line `make` shows."""


def link_torch(env: Path) -> str:
    """Put the running interpreter's torch on `env`'s path; return its version."""
    try:
        torch = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(f"{sys.executable} has no torch to share: run `make install` first") from None
    site = Path(torch.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in torch.files or []} - {".."}  # bin/ scripts sit outside site-packages
    shared = env / "shared-torch"
    shared.mkdir()
    for top in sorted(tops):
        if (site / top).exists():
            (shared / top).symlink_to(os.path.relpath(site / top, shared))
    purelib = Path(subprocess.check_output(
        [str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    # a relative line of a .pth file is taken relative to the site directory: the environment can move with .venv
    (purelib / "shared-torch.pth").write_text(os.path.relpath(shared, purelib) + "\n")
    return torch.version


def run_step(what: str, command: list[str], log: Path) -> str:
    """Run one step, its output appended to `log`; raise BuildError naming it when it fails."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=out, text=True)
        out.write(done.stdout)
    if done.returncode != 0:
        raise BuildError(f"{what} failed (exit {done.returncode}; see {log})")
    return done.stdout


def build(env: Path, requirements: Path = REQUIREMENTS) -> str:
    """Build `env` from scratch from `requirements`; return the versions line of its check."""
    if env.exists():
        shutil.rmtree(env)
    # pip comes from ensurepip: the standard library's, no download
    venv.EnvBuilder(with_pip=True, symlinks=True).create(env)
    log = env / "build.log"
    torch_version = link_torch(env)
    python = str(env / "bin" / "python")
    shown = requirements.relative_to(ROOT) if requirements.is_relative_to(ROOT) else requirements
    run_step(f"pip install --no-deps -r {shown}",
             [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", "--no-input",
              "-r", str(requirements)], log)
    versions = run_step("importing pylate and FlagEmbedding in the reference environment",
                        [python, "-c", CHECK], log).strip()
    if f"torch=={torch_version}" not in versions.split():
        raise BuildError(f"the reference environment's torch is not .venv's {torch_version}: {versions}")
    (env / STAMP_NAME).write_text(versions + "\n")
    return versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", type=Path, default=DEFAULT_ENV, help="where to build it (default: .venv-reference)")
    parser.add_argument("--requirements", type=Path, default=REQUIREMENTS,
                        help="the pinned closure to install (default: tests/reference/requirements.txt)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        versions = build(args.env.resolve(), args.requirements.resolve())
    except (BuildError, OSError, subprocess.CalledProcessError) as error:
        print(f"make reference-envs: {error}", file=sys.stderr)
        return 1
    size = subprocess.run(["du", "-sm", str(args.env)], capture_output=True, text=True).stdout.split()[0]
    print(f"reference environment {args.env}: {versions}; built in {time.monotonic() - started:.0f} s, {size} MB "
          "(torch shared with .venv)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
