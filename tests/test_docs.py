"""The docs stay true and short: every TORCH_HCA_* variable the code reads is documented, every
documented one is read, and the settings module knows them all; the README's options table is
torch_hca.Options; links between the docs resolve; the README and the reference docs say what is,
briefly (their lengths, short table cells, no dates or issue numbers in headings), the history apart."""
import dataclasses
import glob
import os
import re
import subprocess

import torch_hca
from torch_hca.options import ENV_PREFIX
from torch_hca.settings import known_variables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
HISTORY = sorted(glob.glob(os.path.join(ROOT, "docs", "history", "*.md")))
DOCS = REFERENCE + [os.path.join(ROOT, "benchmarks", "results", "README.md")] + HISTORY
VARIABLE = re.compile(r"TORCH_HCA_[A-Z0-9_]*[A-Z0-9]")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def variables_read_by_the_code():
    """Literal names in the sources and the build, the names the Python side composes from
    ENV_PREFIX, and one per Options field (Options.from_env)."""
    names = set()
    sources = glob.glob(os.path.join(ROOT, "csrc", "**", "*.*"), recursive=True)
    sources += glob.glob(os.path.join(ROOT, "torch_hca", "*.py")) + [os.path.join(ROOT, "setup.py")]
    sources += glob.glob(os.path.join(ROOT, "tools", "*.sh"))
    for path in sources:
        if path.endswith((".cpp", ".h", ".hpp", ".cu", ".cuh", ".py", ".sh")):
            text = _read(path)
            names.update(VARIABLE.findall(text))
            names.update(ENV_PREFIX + n for n in re.findall(r'ENV_PREFIX \+ "([A-Z0-9_]+)"', text))
            names.update(ENV_PREFIX + n for n in re.findall(r'_env_int\("([A-Z0-9_]+)"', text))
    names.update(ENV_PREFIX + f.name.upper() for f in dataclasses.fields(torch_hca.Options))
    return names


def test_every_variable_the_code_reads_is_in_the_table_and_no_other():
    troubleshooting = _read(os.path.join(ROOT, "docs", "troubleshooting.md"))
    table = troubleshooting[troubleshooting.index("## Environment variables"):]
    in_table = set(re.findall(r"^\| `(TORCH_HCA_[A-Z0-9_]+)` \|", table, re.M))
    read = variables_read_by_the_code()
    assert read - in_table == set(), "read but not documented"
    assert in_table - read == set(), "documented but never read"
    # The names a group's creation knows (any other set is warned about as a likely typo).
    assert sorted(known_variables()) == sorted(in_table)
    mentioned = set().union(*(VARIABLE.findall(_read(p)) for p in DOCS))
    assert mentioned - read == set(), "the docs name variables the code does not read"


def _options_table():
    readme = _read(os.path.join(ROOT, "README.md"))
    section = readme[readme.index("## Options"):]
    section = section[:section.index("\n## ", 1)]
    return [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]


def test_the_readme_options_table_is_torch_hca_options():
    rows = _options_table()
    fields = dataclasses.fields(torch_hca.Options)
    assert [row[0] for row in rows] == [f"`{f.name}`" for f in fields]
    for row, field in zip(rows, fields):
        assert row[1].startswith(f"`{ENV_PREFIX}{field.name.upper()}`"), row
        assert row[2] == f"`{field.default!r}`".replace("'", '"'), (row, field.default)


def _anchors(path):
    """The anchors GitHub makes of a Markdown file's headings: lower case, punctuation dropped
    (but hyphens and underscores), spaces to hyphens."""
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", _read(path), re.M):
        slugs.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return slugs


def test_links_between_the_docs_resolve():
    """Every relative link names a file that exists, and every #anchor into a Markdown file a
    heading there (the link itself is checked, not the text around it)."""
    for path in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", _read(path)):
            if target.startswith("http"):
                continue
            resolved = os.path.join(os.path.dirname(path), target) if target else path
            assert os.path.exists(resolved), (path, target)
            if anchor and resolved.endswith(".md"):
                assert anchor in _anchors(resolved), (path, target, anchor)


def test_nothing_points_outside_the_repository_for_the_design():
    """The design lives in docs/design.md: no file a user gets names a folder they do not have."""
    tracked = glob.glob(os.path.join(ROOT, "**", "*.*"), recursive=True)
    for path in tracked:
        if "/build/" in path or "/.git/" in path or not path.endswith((".md", ".py", ".cpp", ".h", ".hpp", ".sh")):
            continue
        text = _read(path)
        for phrase in ("../" + "shared", "shared " + "design folder", "DESIGN" + ".md"):  # split: not found here
            assert phrase not in text, (path, phrase)


def test_every_result_file_is_in_the_results_index():
    """benchmarks/results/README.md lists every file the repository holds there (brace and *
    patterns allowed). What a local `make run` writes beside them (untracked) is not checked:
    the README's two commands, run in order on a fresh clone, must pass."""
    import fnmatch

    results = os.path.join(ROOT, "benchmarks", "results")
    index = _read(os.path.join(results, "README.md"))

    def expand(pattern):
        m = re.search(r"\{([^}]*)\}", pattern)
        return [pattern] if not m else [e for alt in m.group(1).split(",")
                                        for e in expand(pattern[:m.start()] + alt + pattern[m.end():])]

    patterns = [e.rstrip("/") for p in re.findall(r"`([^`]+)`", index) for e in expand(p)]
    for name in _repository_files(results):
        if name != "README.md":
            assert any(fnmatch.fnmatch(name, p) for p in patterns), name


def _repository_files(folder):
    """The names in `folder` that git tracks (files or subfolders); every name outside a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=folder, capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return os.listdir(folder)
    return sorted({path.split("/")[0] for path in listed.split("\0") if path})


def test_the_readme_and_performance_page_are_short():
    assert len(_read(os.path.join(ROOT, "README.md")).splitlines()) <= 150
    assert len(_read(os.path.join(ROOT, "docs", "performance.md")).splitlines()) <= 400


def test_no_table_cell_runs_past_forty_words():
    for path in REFERENCE:
        for number, line in enumerate(_read(path).splitlines(), 1):
            if line.startswith("|"):
                for cell in line.strip().strip("|").split("|"):
                    assert len(cell.split()) <= 40, (path, number, cell[:80])


def test_reference_headings_carry_no_dates_and_no_doc_names_an_issue_number():
    """Dated narratives live in docs/history/; issue numbers mean nothing to a reader anywhere."""
    for path in REFERENCE:
        for heading in re.findall(r"^#+ (.+)$", _read(path), re.M):
            assert not re.search(r"\b20\d\d-\d\d(-\d\d)?\b", heading), (path, heading)
    for path in DOCS:
        assert not re.search(r"\b[Ii]ssues? #?\d+", _read(path)), path
