"""README.md and docs/*.md name only what exists: repository paths, config options, dotted
names, links and metric keys; every link stays inside the repository; and every metric the code
produces is defined on the metrics page.

Only inline code spans are read (text in backticks); spans with a placeholder (``<name>``,
``…``, ``*`` where not a glob) are patterns, not names, and are skipped. The text of a generated
table (between ``<!-- table: … -->`` and ``<!-- /table -->``, written by ``make docs`` from
tables/) is left out: it is checked against its table by tests/test_docs_numbers.py.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from uqbench import metrics as M

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUPS = ("backbone", "method", "dataset", "trainer", "task", "logger", "experiment", "paths")
SPLITS = ("<split>", "test", "val", "ood", "test_c")


def written(page: Path) -> str:
    """A page's text without its generated tables (see the module docstring)."""
    return re.sub(r"<!-- table: [^\n]*? -->\n.*?<!-- /table -->", "", page.read_text(),
                  flags=re.S)


def spans(page: Path) -> list[str]:
    """The inline code spans of a page (fenced blocks and generated tables left out)."""
    text = re.sub(r"```.*?```", "", written(page), flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def tokens(page: Path) -> list[str]:
    """Every whitespace-separated token of every code span."""
    return [t for s in spans(page) for t in s.split()]


def group_keys(group: str) -> set[str]:
    """Top-level keys of every YAML of a config group (sub-folders included)."""
    keys: set[str] = set()
    for path in (ROOT / "conf" / group).rglob("*.yaml"):
        node = yaml.safe_load(path.read_text()) or {}
        keys |= {str(k) for k in node}
    return keys


def defined(module: Path, names: list[str]) -> bool:
    """Whether ``names[0]`` is defined at the top of ``module`` (and ``names[1]`` inside it)."""
    body = ast.parse(module.read_text()).body
    for name in names:
        found = None
        for node in body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                found = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
            elif isinstance(node, ast.ImportFrom | ast.Import):
                if any((a.asname or a.name).split(".")[-1] == name for a in node.names):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.fixture(scope="module")
def produced() -> set[str]:
    """The metric names the code writes under ``<split>/``: classification, OOD, regression,
    noise recovery and the BNN's diagnostics, each computed on a tiny input."""
    from uqbench.backbones.mlp import MLP
    from uqbench.contracts import DataInfo
    from uqbench.methods.bnn import BayesianMLP

    probs = torch.tensor([[[0.7, 0.3], [0.4, 0.6]], [[0.6, 0.4], [0.2, 0.8]]])  # (M, N, C)
    y = torch.tensor([0, 1])
    names = set(M.classification_metrics(probs, y))
    names |= {f"{k}_{s}" for k in M.ood_detection(torch.tensor([0.1, 0.2]),
                                                   torch.tensor([0.3, 0.4]))
              for s in (*M.OOD_SCORES, *M.LOGIT_SCORES)}
    t = torch.tensor([[0.0], [1.0]])
    names |= set(M.regression_metrics(t, t, t + 1)) | set(M.noise_recovery(t + 1, t + 1))
    for variance in ("embedded", "learned"):  # learned adds the total's two parts
        for covariance in ("diagonal", "full"):  # full adds its cost and the closure bound
            bnn = BayesianMLP(MLP(width=2), DataInfo(task="regression", in_dim=1, out_dim=1),
                              check_samples=4, variance=variance, covariance=covariance)
            names |= set(bnn.diagnostics(t))
    # the conformal sets' and intervals' keys, <split>/cp_<score>/<name> and <split>/cp/<name>
    from uqbench.tasks.classification import ClassificationTask
    from uqbench.tasks.regression import RegressionTask

    cls = {"member_probs": probs.numpy(), "labels": y.numpy()}
    task = ClassificationTask(conformal=["thr", "aps", "raps"])
    names |= {k.split("/")[-1] for k in task.metrics("test", cls, task.calibrate(cls))}
    reg = {"y": t.numpy(), "mean": t.numpy(), "var": (t + 1).numpy()}
    rtask = RegressionTask()
    names |= {k.split("/")[-1] for k in rtask.metrics("test", reg, rtask.calibrate(reg))}
    return names


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_named_paths_exist(page):
    missing = [s for s in spans(page) if s.startswith(("uqbench/", "conf/", "tests/", "docs/"))
               and not re.search(r"[<>{}*… ]", s) and not (ROOT / s).exists()]
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_named_config_options_and_keys_exist(page):
    bad = []
    for token in tokens(page):
        if "<" in token or "$" in token:
            continue
        match = re.fullmatch(rf"({'|'.join(GROUPS)})=([\w*,]+)", token)
        if match:
            group, options = match.groups()
            for option in options.split(","):
                if not list((ROOT / "conf" / group).glob(f"{option}.yaml")):
                    bad.append(token)
            continue
        match = re.match(rf"({'|'.join(GROUPS[:-2])})\.(\w+)", token)
        if match and match.group(2) not in group_keys(match.group(1)):
            bad.append(token)
    assert not bad, f"{page_id(page)} names config options or keys that no YAML has: {bad}"


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_named_dotted_names_exist(page):
    bad = []
    for token in tokens(page):
        name = token.split("(")[0]
        if not re.fullmatch(r"uqbench(\.\w+)+", name):
            continue
        parts, path = name.split("."), ROOT
        while parts and ((path / parts[0]).is_dir() or (path / f"{parts[0]}.py").is_file()):
            path = path / parts.pop(0)
        module = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if name == "uqbench.conf":  # the configs' package: conf/ (see pyproject.toml)
            continue
        if not module.is_file() or (parts and not defined(module, parts)):
            bad.append(name)
    assert not bad, f"{page_id(page)} names modules or attributes that do not exist: {bad}"


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_links_between_pages_resolve(page):
    def anchors(target: Path) -> set[str]:
        heads = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}

    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", written(page)):
        file, _, anchor = link.partition("#")
        target = (page.parent / file).resolve() if file else page
        if not target.exists() or (anchor and target.suffix == ".md"
                                   and anchor not in anchors(target)):
            bad.append(link)
    assert not bad, f"{page_id(page)} has links that resolve to nothing: {bad}"


def test_every_listed_metric_key_is_produced_and_every_metric_listed(produced):
    page = ROOT / "docs" / "metrics.md"
    listed, bases = set(), set()
    for token in tokens(page):
        if not token.startswith(tuple(f"{s}/" for s in SPLITS)):
            continue
        last = token.split("/")[-1]
        if last.endswith("_<s>"):  # an OOD key over the scores, e.g. ood/auroc_<s>
            bases.add(last[:-len("_<s>")])
        elif not re.search(r"[<*…]", last) and not re.fullmatch(r"\d+", last):
            listed.add(last)
    unknown = {m for m in listed if m not in produced}
    unknown |= {b for b in bases if not any(p == f"{b}_{s}" for p in produced
                                            for s in (*M.OOD_SCORES, *M.LOGIT_SCORES))}
    assert not unknown, f"docs/metrics.md lists metrics the code does not produce: {unknown}"
    scores = set(spans(page))
    covered = listed | {f"{b}_{s}" for b in bases for s in (*M.OOD_SCORES, *M.LOGIT_SCORES)
                        if s in scores}
    assert produced <= covered, (f"metrics the code produces that docs/metrics.md does not "
                                 f"define: {sorted(produced - covered)}")


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_no_page_points_outside_the_repository(page):
    """A link or an image is a path inside the repository: no web address, no absolute path,
    no ``..`` that climbs out of it; and no bare web address in the text either."""
    text = written(page)
    bad = [link for link in re.findall(r"\]\(([^)\s]+)\)", text)
           if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith("/")
           or not (page.parent / link.partition("#")[0]).resolve().is_relative_to(ROOT)]
    bad += re.findall(r"<?https?://[^\s)>]+", text)
    assert not bad, f"{page_id(page)} points outside the repository: {bad}"


def test_make_help_lists_every_documented_target():
    """Every Makefile target with a ``## what it does`` comment is listed by ``make help``,
    with that text (names with digits included: ``p1-digits``)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    makefile = (ROOT / "Makefile").read_text()
    documented = dict(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)[^\n]*?##\s*(.+)$", makefile,
                                 flags=re.M))
    assert {"help", "p1-digits", "p1-digits-lr", "p1-tables", "docs"} <= set(documented)
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    listed = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines():
        name, _, text = line.strip().partition(" ")
        listed[name] = text.strip()
    assert {name: listed.get(name) for name in documented} == documented


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_no_control_characters(page):
    """A formula written through a non-raw Python string loses its backslashes to control
    characters (``\\frac`` → form feed + ``rac``, ``\\bar`` → backspace, ``\\text`` → tab),
    and renders broken. Only newlines may appear below U+0020."""
    data = page.read_bytes()
    bad = [(data.count(b"\n", 0, i) + 1, repr(chr(c))) for i, c in enumerate(data)
           if c < 0x20 and c != 0x0A]
    assert not bad, f"{page.name}: control characters at (line, character) {bad[:10]}"


def test_the_readme_is_a_front_door():
    """At most 150 lines: what it is, the commands, what a first run prints and writes, one
    results table per paper, and the map of the docs (the research lives in docs/)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for heading in ("## Quickstart", "## A first run", "## Results", "## Documentation"):
        assert heading in text
    assert "make test" in text and "results.json" in text and "docs/figures/first_run.png" in text
    assert (ROOT / "docs" / "figures" / "first_run.png").is_file()
    assert text.count("<!-- table: ") == 2  # one table per paper
