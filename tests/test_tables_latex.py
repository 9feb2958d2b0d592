"""The LaTeX `uqbench-tables` writes: Unicode as LaTeX, specials escaped, numeric row keys
formatted, and every table compiles with pdflatex inside a minimal document (booktabs).

Without pdflatex the compile tests skip, unless UQBENCH_REQUIRE_LATEX=1 (CI), where they fail;
`make latex` installs it (Debian)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from uqbench.report.latex import latex_text
from uqbench.report.tables import main

ROOT = Path(__file__).resolve().parents[1]

# A P1-like table with the paper's numbers beside ours; string and integer row keys, a
# setting without NLL (its cells show "–"), specials in the title and the headers.
P1 = {"title": "Paper 1 — Flowers102 (ACC & ECE in %; #seeds = 3, cost ~ $0)",
      "rows": [{"key": "method", "title": "method"},
               {"key": "settings.method.members", "title": "M"}],
      "columns": [{"key": "metrics.test/acc", "title": "ACC %", "fmt": ".1f", "scale": 100},
                  {"key": "metrics.test/nll", "title": "NLL_test", "fmt": ".2f"},
                  {"key": "metrics.test/ece", "title": "ECE {TS}", "fmt": ".1f", "scale": 100}],
      "paper": [{"row": {"method": "deep_ensemble", "M": 4}, "values": {"ACC %": 91.5}},
                {"row": {"method": "sve", "M": 4}, "values": {"ACC %": 95.4, "NLL_test": 0.18}}]}
# A P2-like table: float row keys (ρ₀ = -2.0 was written as -2.000000), Greek in titles
P2 = {"title": "Paper 2 — sensitivity to ρ₀ (σ₀ = softplus(ρ₀)), 10⁻² ≤ β ≤ 1, x^2 \\ y",
      "rows": [{"key": "settings.backbone.width", "title": "width"},
               {"key": "settings.method.rho_init", "title": "ρ₀"},
               {"key": "settings.method.variance", "title": "variance"}],
      "columns": [{"key": "metrics.test/cov", "title": "cov ±2σ", "fmt": ".3f"},
                  {"key": "metrics.test/ratio", "title": "σ / true σ", "fmt": ".3f"},
                  {"key": "params.trainable", "title": "params (k)", "fmt": ".1f",
                   "scale": 1e-3}]}
# Row keys that are booleans or absent, and characters LaTeX's fonts print as others
ODD = {"title": "Odd <keys> | naïve µ-scale, Wᵀx, Δ & Ω, 5 °C – done…",
       "rows": [{"key": "settings.method.finetune", "title": "fine-tune?"},
                {"key": "settings.method.rank", "title": "k", "fmt": ".0f"}],
       "columns": [{"key": "metrics.test/acc", "title": "acc ≈ μ", "fmt": ".3f"}]}


def _set(obj: dict, dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[leaf] = value


def _write(root: Path, exp: str, spec: dict, settings: list[dict], values: dict) -> None:
    """Three seeds of every setting (row key → value), each key of ``values`` set to its value
    + seed / 100, or to ``value(setting, seed)`` for a function (absent where it gives None)."""
    for i, setting in enumerate(settings):
        for seed in range(3):
            run = {"experiment": exp, "seed": seed, "metrics": {}, "table": spec}
            for key, value in setting.items():
                _set(run, key, value)
            for key, value in values.items():
                value = value(setting, seed) if callable(value) else value + seed / 100
                if value is not None:
                    _set(run, key, value)
            path = root / exp / f"s{i}" / f"seed{seed}" / "results.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(run))


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("latex")
    runs = root / "runs"
    _write(runs, "p1_paper", P1, [
        {"method": m, "settings.method.members": 4} for m in ("deep_ensemble", "lora_ensemble",
                                                                "sve")],
        {"metrics.test/acc": 0.9, "metrics.test/ece": 0.02,
         "metrics.test/nll": lambda s, seed: (None if s["method"] == "lora_ensemble"
                                              else 0.3 + seed / 100)})
    _write(runs, "p2_rho", P2, [
        {"settings.backbone.width": w, "settings.method.rho_init": rho,
         "settings.method.variance": v}
        for w in (4, 1024) for rho in (-2.0, 0.5) for v in ("embedded", "learned")],
        {"metrics.test/cov": 0.9, "metrics.test/ratio": 1.1,
         "params.trainable": lambda s, seed: 1234})
    _write(runs, "odd", ODD, [{"settings.method.finetune": True, "settings.method.rank": None},
                              {"settings.method.finetune": False, "settings.method.rank": 8}],
           {"metrics.test/acc": 0.5})
    main(["--runs", str(runs), "--out", str(root / "tables"), "--quiet"])
    return root / "tables"


def test_unicode_becomes_latex_and_specials_are_escaped():
    # expected strings written by hand from LaTeX's rules
    assert latex_text("ρ₀") == r"$\rho_{0}$"
    assert latex_text("cov ±2σ") == r"cov $\pm$2$\sigma$"
    assert latex_text("10⁻²") == r"10$^{-2}$"
    assert latex_text("a – b — c…") == r"a -- b --- c\ldots{}"
    assert latex_text("5% & #1_a $x {y}") == r"5\% \& \#1\_a \$x \{y\}"
    assert latex_text("~^\\") == r"\textasciitilde{}\textasciicircum{}\textbackslash{}"
    assert latex_text("-2 (-0.5) 1e-05 x-1") == r"$-$2 ($-$0.5) 1e-05 x-1"
    unknown: set[str] = set()
    assert latex_text("naïve €", unknown) == "naïve ?" and unknown == {"€"}


def test_the_tex_has_booktabs_caption_label_and_formatted_keys(tables):
    tex = (tables / "p2_rho.tex").read_text()
    for part in (r"\toprule", r"\midrule", r"\bottomrule", r"\label{tab:p2_rho}",
                 r"\caption{Paper 2 --- sensitivity to $\rho_{0}$ ($\sigma_{0}$ = "
                 r"softplus($\rho_{0}$)), 10$^{-2}$ $\leq$ $\beta$ $\leq$ 1, "
                 r"x\textasciicircum{}2 \textbackslash{} y}",
                 r"width & $\rho_{0}$ & variance & cov $\pm$2$\sigma$ & $\sigma$ / true "
                 r"$\sigma$ & params (k) & seeds \\",
                 # width 4, ρ₀ -2.0 (.4g: -2), cov 0.9, 0.91, 0.92: mean 0.910, std 0.010
                 r"4 & $-$2 & embedded & 0.910 $\pm$ 0.010 & 1.110 $\pm$ 0.010 & 1.2 & 3 \\",
                 r"1024 & 0.5 & learned &"):
        assert part in tex, part
    assert "-2.000000" not in tex and "−" not in tex
    p1 = (tables / "p1_paper.tex").read_text()
    assert r"\caption{Paper 1 --- Flowers102 (ACC \& ECE in \%; \#seeds = 3, cost " \
           r"\textasciitilde{} \$0)}" in p1
    assert r"method & M & ACC \% & ACC \% (paper) & NLL\_test & NLL\_test (paper) & " \
           r"ECE \{TS\} & seeds \\" in p1
    # ACC 0.90, 0.91, 0.92 × 100 → 91.0 ± 1.0 (ECE 3.0 ± 1.0 alike); the paper's 95.4 and
    # 0.18 beside SVE's; lora_ensemble has no NLL and no paper row: –
    assert r"sve & 4 & 91.0 $\pm$ 1.0 & 95.4 & 0.31 $\pm$ 0.01 & 0.18 & 3.0 $\pm$ 1.0 & 3 \\" \
        in p1
    assert r"lora\_ensemble & 4 & 91.0 $\pm$ 1.0 & -- & -- & -- & 3.0 $\pm$ 1.0 & 3 \\" in p1
    odd = (tables / "odd.tex").read_text()
    assert r"False & 8 & 0.510 $\pm$ 0.010 & 3 \\" in odd and r"True & -- &" in odd
    for tex in (tables / "p1_paper.tex", tables / "p2_rho.tex", tables / "odd.tex"):
        assert max(map(ord, tex.read_text())) <= 0xFF, tex  # Latin-1 at most: pdflatex reads it


def _require_pdflatex() -> str:
    found = shutil.which("pdflatex")
    if found:
        return found
    if os.environ.get("UQBENCH_REQUIRE_LATEX") == "1":
        pytest.fail("UQBENCH_REQUIRE_LATEX=1 but pdflatex is not on PATH; install it with "
                    "`make latex` (Debian, as root)")
    pytest.skip("pdflatex is not on PATH: the .tex is not compiled (install it with `make "
                "latex`; UQBENCH_REQUIRE_LATEX=1 turns this skip into a failure)")


def compile_tex(tables: list[Path], workdir: Path) -> Path:
    """Compile ``tables`` (.tex files) inside a minimal article with booktabs; the PDF (or a
    failure that shows pdflatex's log)."""
    pdflatex = _require_pdflatex()
    workdir.mkdir(parents=True, exist_ok=True)
    inputs = []
    for i, tex in enumerate(tables):  # plain names: \input needs no quoting
        shutil.copy(tex, workdir / f"table{i}.tex")
        inputs.append(f"\\input{{table{i}.tex}}\n")
    (workdir / "doc.tex").write_text("\\documentclass{article}\n\\usepackage{booktabs}\n"
                                     "\\begin{document}\n" + "".join(inputs)
                                     + "\\end{document}\n")
    proc = subprocess.run([pdflatex, "-interaction=nonstopmode", "-halt-on-error", "doc.tex"],
                          cwd=workdir, capture_output=True, text=True, timeout=120)
    names = ", ".join(t.name for t in tables)
    assert proc.returncode == 0, f"{names} do not compile:\n{proc.stdout[-3000:]}"
    pdf = workdir / "doc.pdf"
    assert pdf.is_file() and pdf.stat().st_size > 0
    return pdf


@pytest.mark.parametrize("exp", ["p1_paper", "p2_rho", "odd"])
def test_each_table_compiles_with_pdflatex(tables, tmp_path, exp):
    compile_tex([tables / f"{exp}.tex"], tmp_path)


@pytest.mark.slow
def test_every_experiment_config_table_compiles_with_pdflatex(tmp_path):
    """The titles and headers of conf/experiment/*.yaml, on made-up runs (two settings, the
    first row key numeric, the others text), compile (in one document: one pdflatex run)."""
    runs, compiled, expected = tmp_path / "runs", 0, set()
    for path in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        spec = (yaml.safe_load(path.read_text()) or {}).get("table") or {}
        if "rows" not in spec or "columns" not in spec:  # a layout over another experiment's
            continue
        # the experiment's table, each subtable of its config, its claims table where asked
        expected |= {path.stem, *(f"{path.stem}_{n}" for n in spec.get("subtables") or {}),
                     *([f"{path.stem}_claims"] if spec.get("claims_tex") else [])}
        spec = {k: spec[k] for k in ("title", "rows", "columns", "paper") if k in spec}
        # a row keyed by the run's own seed (p2_depth_seeds) takes the seeds _write gives
        keys = [r["key"] for r in spec["rows"] if r["key"] != "seed"]
        settings = [{k: (i + 1.5 if j == 0 else f"set_{i}") for j, k in enumerate(keys)}
                    for i in range(2)]
        _write(runs, path.stem, spec, settings, {c["key"]: 0.25 for c in spec["columns"]})
        compiled += 1
    main(["--runs", str(runs), "--out", str(tmp_path / "tables"), "--quiet"])
    assert compiled >= 15
    tex = sorted((tmp_path / "tables").glob("*.tex"))
    assert {t.stem for t in tex} == expected
    compile_tex(tex, tmp_path / "build")
