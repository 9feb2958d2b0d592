"""The documentation site (uqbench/report/site.py, `make docs-site`): every formula the pages
hold is found in order and replaced by its typeset HTML; one KaTeX cannot typeset fails the
build naming its page; and the docs' sources hold only formulas with balanced braces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from uqbench.report import site as S

ROOT = Path(__file__).resolve().parents[1]
PAGE = ('<html><head></head><body><p>a <span class="arithmatex">\\(x^2\\)</span> and</p>'
        '<div class="arithmatex">\\[\\frac{a}{b} &lt; 1\\]</div>'
        '<p><span class="arithmatex">\\(\\bar p\\)</span></p></body></html>')


def test_formulas_are_found_in_order_with_their_kind_and_entities_undone():
    assert S.formulas(PAGE) == [("x^2", False), ("\\frac{a}{b} < 1", True), ("\\bar p", False)]


def test_each_formula_is_replaced_by_its_own_typeset_html(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    for path in (tmp_path / "index.html", tmp_path / "sub" / "page.html"):
        path.write_text(PAGE)
    katex = tmp_path / "katex"
    (katex / "dist" / "fonts").mkdir(parents=True)
    (katex / "dist" / "katex.min.css").write_text("/* css */")
    seen = []

    def fake(items, _katex):
        seen.extend(items)
        return [{"html": f"<b>{i}</b>"} for i in range(len(items))]

    monkeypatch.setattr(S, "typeset", fake)
    assert S.render_site(tmp_path, katex) == 6
    index, page = (tmp_path / "index.html").read_text(), (tmp_path / "sub/page.html").read_text()
    assert re.findall(r"<b>\d</b>", index) == ["<b>0</b>", "<b>1</b>", "<b>2</b>"]
    assert re.findall(r"<b>\d</b>", page) == ["<b>3</b>", "<b>4</b>", "<b>5</b>"]
    assert "arithmatex" not in index + page
    assert 'href="assets/katex/katex.min.css"' in index
    assert 'href="../assets/katex/katex.min.css"' in page  # relative to the page's folder
    assert (tmp_path / "assets" / "katex" / "katex.min.css").is_file()
    assert [tex for tex, _ in seen[:3]] == ["x^2", "\\frac{a}{b} < 1", "\\bar p"]


def test_a_formula_katex_refuses_fails_the_build_naming_its_page(tmp_path, monkeypatch):
    (tmp_path / "metrics.html").write_text(PAGE)
    monkeypatch.setattr(S, "typeset", lambda items, _: [
        {"error": "Undefined control sequence: \\fracc"} if "frac" in tex else {"html": "ok"}
        for tex, _ in items])
    with pytest.raises(S.MathError, match=r"metrics.html: '\\\\frac\{a\}\{b\} < 1': Undefined"):
        S.render_site(tmp_path, tmp_path)
    assert (tmp_path / "metrics.html").read_text() == PAGE  # left as built


def _braces_balance(tex: str) -> bool:
    depth = 0
    for i, ch in enumerate(tex):
        if ch in "{}" and i and tex[i - 1] == "\\":
            continue  # \{ and \} are characters, not groups
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_every_formula_in_the_docs_sources_has_balanced_braces(page):
    text = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(), flags=re.S)  # code is no math
    for tex in re.findall(r"\$\$(.+?)\$\$|\$([^$\n]+)\$", text):
        formula = tex[0] or tex[1]
        assert _braces_balance(formula), f"{page.name}: unbalanced braces in ${formula}$"
