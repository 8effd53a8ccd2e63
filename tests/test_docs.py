"""README.md and docs/ kept honest where a machine can check them: every relative link (and its
anchor) resolves, every `make TARGET` named is a Makefile target, every flag named for a
`python -m MODULE` command is in that command's --help, every setting is on the configuration page,
every test file on the testing page; and make bench's headline writer keeps the README's markers.
Seconds: the --help subprocesses are the slowest part."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "RELIABILITY.md"]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
# the make variables that carry a command's flags: make run SERVE_ARGS='--port 9000'
ARGS_VARIABLES = {"SERVE_ARGS": "service", "EXPORT_ARGS": "export", "BENCH_ARGS": "benchmarks.bench",
                  "LOADTEST_ARGS": "loadtests.run", "SOAK_ARGS": "loadtests.soak"}
COMMAND = re.compile(r"python3? -m ([\w.]+)((?:\s+(?!\||&&|;|#)\S+)*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def split(text: str) -> tuple[list[str], list[str]]:
    """The page's prose lines and its code-block lines (continuations joined)."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            prose.append(line)
        elif code and (code[-1].endswith("\\") or re.match(r"\s+\[--", line)):
            code[-1] = code[-1].rstrip("\\") + " " + line.strip()  # a command continued on the next line
        else:
            code.append(line)
    return prose, code


def code_snippets(text: str) -> list[str]:
    """Every piece of code a reader might type: code-block lines and inline code spans."""
    prose, code = split(text)
    return code + [m.group(1) for line in prose for m in INLINE_CODE.finditer(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    prose, _ = split(page.read_text())
    return {slug(line.lstrip("#")) for line in prose if re.match(r"#{1,6} ", line)}


def links(page: Path) -> list[str]:
    prose, _ = split(page.read_text())
    return [m.group(1) for line in prose for m in LINK.finditer(line)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"(?m)^([A-Za-z0-9_-]+)\s*:(?!=)", text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_named_exists(page):
    targets = makefile_targets()
    named = {m.group(1) for snippet in code_snippets(page.read_text())
             for m in re.finditer(r"(?<![\w-])make ([a-z][\w-]*)", snippet)}
    missing = sorted(named - targets)
    assert not missing, f"{page.name} names make targets the Makefile does not have: {missing}"


@functools.cache
def help_text(module: str) -> str:
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return done.stdout + done.stderr


def flags_named(text: str) -> list[tuple[str, str, str]]:
    """(module, flag, the snippet) for each flag given to a `python -m MODULE` command or through
    the make variable that carries that command's flags."""
    found = []
    for snippet in code_snippets(text):
        for m in COMMAND.finditer(snippet):
            found += [(m.group(1), f, snippet) for f in FLAG.findall(m.group(2))]
        for variable, module in ARGS_VARIABLES.items():
            for m in re.finditer(variable + r"=(?:'([^']*)'|\"([^\"]*)\"|(\S+))", snippet):
                found += [(module, f, snippet) for f in FLAG.findall(next(g for g in m.groups() if g is not None))]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_named_is_in_its_commands_help(page):
    unknown = [f"python -m {module} {flag} (in: {snippet.strip()[:100]})"
               for module, flag, snippet in flags_named(page.read_text())
               if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text(module))]
    assert not unknown, f"{page.name} names flags their command's --help does not list: " + "; ".join(unknown)


def test_the_checks_find_what_they_look_for():
    """The three checks above can fail: each finds a planted mistake."""
    page = "see [x](missing.md) and [y](serving.md#no-such-heading)\n```bash\nmake no-such-target\n" \
           "python -m service --no-such-flag --port 1\n```\n"
    assert links_of(page) == ["missing.md", "serving.md#no-such-heading"]
    assert "no-such-heading" not in anchors(ROOT / "docs" / "serving.md")
    assert any(m.group(1) == "no-such-target" for s in code_snippets(page)
               for m in re.finditer(r"make ([a-z][\w-]*)", s)) and "no-such-target" not in makefile_targets()
    flags = [f for _, f, _ in flags_named(page)]
    assert flags == ["--no-such-flag", "--port"]
    assert "--no-such-flag" not in help_text("service") and "--port" in help_text("service")
    assert flags_named("`make run SERVE_ARGS='--replicas 2'`") == [("service", "--replicas", "make run SERVE_ARGS='--replicas 2'")]


def links_of(text: str) -> list[str]:
    prose, _ = split(text)
    return [m.group(1) for line in prose for m in LINK.finditer(line)]


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines; the details belong in docs/"


def test_every_setting_is_on_the_configuration_page():
    from service.config import AutoscalingSettings, BatchingSettings, ServiceSettings

    page = (ROOT / "docs" / "configuration.md").read_text()
    names = [f"`{n}`" for n in ServiceSettings.model_fields if n != "batching"]
    names += [f"`batching.{n}`" for n in BatchingSettings.model_fields]
    names += [f"`autoscaling.{n}`" for n in AutoscalingSettings.model_fields]
    missing = [n for n in names if n not in page]
    assert not missing, f"docs/configuration.md does not describe {missing}"


def test_every_test_file_is_on_the_testing_page():
    page = (ROOT / "docs" / "testing.md").read_text()
    missing = [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if f"`{p.name}`" not in page]
    assert not missing, f"docs/testing.md does not say what {missing} prove"


def test_bench_writes_compact_headlines_between_the_readme_markers(tmp_path):
    from benchmarks.bench import SUMMARY_END, SUMMARY_START, headline, summary, write_readme

    assert headline("270 texts/s (haproxy, wrk; 8.0 texts per batch) = 0.54x in-process onnxruntime fp32 "
                    "(501 texts/s); 2.04x infinity-emb 0.0.78 (132 texts/s)") == \
        "270 texts/s = 0.54x in-process onnxruntime fp32; 2.04x infinity-emb 0.0.78"
    readme = (ROOT / "README.md").read_text()
    assert readme.count(SUMMARY_START) == 1 and readme.count(SUMMARY_END) == 1
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    goal = {"measure": "p50", "target": "<= 4 ms", "measured": "3.8 ms (haproxy, wrk)", "column": "yes"}
    write_readme(copy, summary([goal], "a machine", Path("docs/performance.md")), SUMMARY_START, SUMMARY_END)
    written = copy.read_text()
    assert "| p50 | 3.8 ms | yes |" in written and "[docs/performance.md](docs/performance.md)" in written
    assert written.split(SUMMARY_START)[0] == readme.split(SUMMARY_START)[0]
    assert written.split(SUMMARY_END)[1] == readme.split(SUMMARY_END)[1]


def request_path(text: str) -> list[str]:
    """The modules a request-path listing names, in order (paths under service/)."""
    return re.findall(r"(?<![\w/.<>])((?:(?:[a-z_]+|<[a-z]+>)/)*(?:[a-z_]+|<[a-z]+>)\.py)", text)


def test_the_request_path_names_real_modules_and_the_docs_page_agrees():
    import service

    doc = service.__doc__
    listing = doc[doc.index("in order:"):]
    named = request_path(listing)
    for module in named:
        if "<" in module:
            continue
        assert (ROOT / "service" / module).is_file(), f"service/__init__.py names {module}, which does not exist"
    apis_line = listing[listing.index("apis/<api>/<module>.py"):].split("validated")[0]
    apis = {p.name for p in (ROOT / "service" / "apis").iterdir() if (p / "__init__.py").is_file()}
    assert apis <= set(re.findall(r"\w+", apis_line)), f"APIs missing from the request path: {apis}"
    page = (ROOT / "docs" / "serving.md").read_text()
    section = page[page.index("## How a request is served"):]
    block = section[section.index("```"):section.index("```", section.index("```") + 3)]
    assert request_path(block) == request_path(listing[:listing.index("\nA gRPC call")]), \
        "docs/serving.md's request path differs from service/__init__.py's"


def test_the_layout_page_names_every_module_and_page():
    page = (ROOT / "docs" / "layout.md").read_text()
    missing = []
    for folder in ("bundle", "export", "service", "jobs", "benchmarks", "loadtests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "__init__.py" and path.parent.name != "service" and path.parent.name != "runtimes":
                continue  # package markers, except the two that say something
            if path.name not in page:
                missing.append(str(path.relative_to(ROOT)))
    missing += [f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in page]
    assert not missing, f"docs/layout.md does not name {missing}"
