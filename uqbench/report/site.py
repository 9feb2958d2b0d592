"""The documentation as a site (``make docs-site``): MkDocs with the Material theme, strict, and
every formula typeset by KaTeX when the site is built.

    python -m uqbench.report.site --katex .cache/katex/node_modules/katex

1. ``mkdocs build --strict`` (``mkdocs.yml``): a link to a missing page or file, an unknown
   anchor or a page left out of the navigation is a warning, and strict makes it an error.
2. Every formula the pages hold (``$…$`` and ``$$…$$``, which ``pymdownx.arithmatex`` keeps as
   ``<span class="arithmatex">\\(…\\)</span>`` and ``<div class="arithmatex">\\[…\\]</div>``) is
   typeset by KaTeX under Node, once per build, with ``throwOnError``: a formula KaTeX cannot
   typeset (an unknown command, an unbalanced brace, a control character left by a string
   that was not raw) fails the build, naming the page and the formula. The typeset HTML
   replaces the source, and KaTeX's stylesheet and fonts are copied into the site, so a page
   shows its mathematics without any script or network.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what pymdownx.arithmatex (generic: true) writes for inline and display formulas
INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)
DISPLAY = re.compile(r'<div class="arithmatex">\\\[(.*?)\\\]</div>', re.S)
STYLESHEET = '<link rel="stylesheet" href="{prefix}assets/katex/katex.min.css">'

# Reads [[tex, display], …] on stdin; writes [{html} or {error}, …] on stdout.
RENDER = """
const katex = require(process.argv[1]);
let text = '';
process.stdin.on('data', d => { text += d; });
process.stdin.on('end', () => {
  const out = JSON.parse(text).map(([tex, display]) => {
    try {
      return {html: katex.renderToString(tex, {displayMode: display, throwOnError: true,
                                               strict: 'error', output: 'html'})};
    } catch (e) { return {error: String(e.message || e)}; }
  });
  process.stdout.write(JSON.stringify(out));
});
"""


class MathError(ValueError):
    """Formulas KaTeX could not typeset (each: page, formula, KaTeX's message)."""


def formulas(page: str) -> list[tuple[str, bool]]:
    """The page's formulas in order of appearance: (TeX source, display?)."""
    found = [(m.start(), html.unescape(m.group(1)), False) for m in INLINE.finditer(page)]
    found += [(m.start(), html.unescape(m.group(1)), True) for m in DISPLAY.finditer(page)]
    return [(tex, display) for _, tex, display in sorted(found)]


def typeset(items: list[tuple[str, bool]], katex: Path) -> list[dict[str, str]]:
    """KaTeX's HTML (or its error) for each (TeX, display) item, in one Node process."""
    if not items:
        return []
    done = subprocess.run(["node", "-e", RENDER, str(katex.resolve())], input=json.dumps(items),
                          capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"node could not run KaTeX from {katex}: {done.stderr.strip()}")
    result: list[dict[str, str]] = json.loads(done.stdout)
    return result


def render_site(site: Path, katex: Path) -> int:
    """Replace every formula of the built ``site`` by KaTeX's HTML, add the stylesheet to the
    pages that have one and copy KaTeX's assets; return the number of formulas typeset, or
    raise :class:`MathError` listing every one that failed (the site is then left as built)."""
    pages = sorted(site.rglob("*.html"))
    texts = {p: p.read_text(encoding="utf-8") for p in pages}
    items = [(p, tex, display) for p in pages for tex, display in formulas(texts[p])]
    rendered = typeset([(tex, display) for _, tex, display in items], katex)
    errors = [f"{p.relative_to(site)}: {tex!r}: {r['error']}"
              for (p, tex, _), r in zip(items, rendered, strict=True) if "error" in r]
    if errors:
        raise MathError(f"{len(errors)} formula(s) KaTeX cannot typeset:\n  "
                        + "\n  ".join(errors))
    by_page: dict[Path, list[str]] = {}
    for (p, _, _), r in zip(items, rendered, strict=True):
        by_page.setdefault(p, []).append(r["html"])
    for p, typeset_html in by_page.items():
        text = _replaced(texts[p], typeset_html)
        prefix = "../" * (len(p.relative_to(site).parts) - 1)
        text = text.replace("</head>", STYLESHEET.format(prefix=prefix) + "</head>", 1)
        p.write_text(text, encoding="utf-8")
    assets = site / "assets" / "katex"
    shutil.rmtree(assets, ignore_errors=True)
    assets.mkdir(parents=True)
    shutil.copy2(katex / "dist" / "katex.min.css", assets / "katex.min.css")
    shutil.copytree(katex / "dist" / "fonts", assets / "fonts")
    return len(items)


def _replaced(page: str, typeset_html: list[str]) -> str:
    """The page with its formulas, in order of appearance, replaced by ``typeset_html``: each
    display formula is first written as an inline one, so that one substitution takes them in
    order (KaTeX's HTML itself says which is display)."""
    queue = iter(typeset_html)
    page = DISPLAY.sub(lambda m: f'<span class="arithmatex">\\({m.group(1)}\\)</span>', page)
    return INLINE.sub(lambda _: next(queue), page)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m uqbench.report.site",
                                     description="Build the documentation site, strictly, "
                                                 "with every formula typeset by KaTeX.")
    parser.add_argument("--katex", type=Path, required=True,
                        help="the katex npm package's folder (node_modules/katex)")
    parser.add_argument("--config", type=Path, default=ROOT / "mkdocs.yml")
    args = parser.parse_args(argv)
    if not (args.katex / "dist" / "katex.min.css").is_file():
        parser.error(f"--katex {args.katex} is not the katex package (no dist/katex.min.css); "
                     f"install it with: npm install --prefix .cache/katex katex")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    built = subprocess.run([str(mkdocs), "build", "--strict", "--config-file", str(args.config)],
                           cwd=args.config.parent, check=False,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    if built.returncode != 0:
        sys.exit(built.returncode)
    found = re.search(r"^site_dir:\s*(\S+)", args.config.read_text(), re.M)
    site = args.config.parent / (found.group(1) if found else "site")
    try:
        n = render_site(site, args.katex)
    except MathError as error:
        sys.exit(f"docs-site: {error}")
    print(f"docs-site: {site} built; {n} formulas typeset")


if __name__ == "__main__":
    main()
