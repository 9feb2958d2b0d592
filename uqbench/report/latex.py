"""A display table as LaTeX that compiles with pdflatex: booktabs, specials escaped, Unicode as
LaTeX (``±`` → ``$\\pm$``, ``σ`` → ``$\\sigma$``, ``ρ₀`` → ``$\\rho_0$``, ``–`` → ``--``)."""

from __future__ import annotations

import re

import pandas as pd

_TEXT = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
         "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
         "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}",
         "–": "--", "—": "---", "…": r"\ldots{}", "‘": "`", "’": "'", "“": "``", "”": "''",
         "†": r"\dag{}", "\u00a0": "~", "\u2009": r"\,", "\u202f": r"\,"}
_GREEK = {"α": "alpha", "β": "beta", "γ": "gamma", "δ": "delta", "ε": "varepsilon",
          "ϵ": "epsilon", "ζ": "zeta", "η": "eta", "θ": "theta", "ϑ": "vartheta", "ι": "iota",
          "κ": "kappa", "λ": "lambda", "μ": "mu", "µ": "mu", "ν": "nu", "ξ": "xi", "π": "pi",
          "ϖ": "varpi", "ρ": "rho", "ϱ": "varrho", "σ": "sigma", "ς": "varsigma", "τ": "tau",
          "υ": "upsilon", "φ": "varphi", "ϕ": "phi", "χ": "chi", "ψ": "psi", "ω": "omega",
          "Γ": "Gamma", "Δ": "Delta", "Θ": "Theta", "Λ": "Lambda", "Ξ": "Xi", "Π": "Pi",
          "Σ": "Sigma", "Υ": "Upsilon", "Φ": "Phi", "Ψ": "Psi", "Ω": "Omega"}
# Math-mode pieces: symbols, Greek letters, and the Greek capitals that look Latin
_MATH = {"±": r"\pm", "∓": r"\mp", "×": r"\times", "·": r"\cdot", "−": "-", "≈": r"\approx",
         "≤": r"\leq", "≥": r"\geq", "≠": r"\neq", "→": r"\rightarrow", "←": r"\leftarrow",
         "↔": r"\leftrightarrow", "⇒": r"\Rightarrow", "∞": r"\infty", "‖": r"\|",
         "∈": r"\in", "∼": r"\sim", "∝": r"\propto", "√": r"\surd", "∑": r"\sum",
         "∏": r"\prod", "∂": r"\partial", "∇": r"\nabla", "°": r"^\circ", "′": r"\prime",
         "¬": r"\neg", "«": r"\ll", "»": r"\gg", "✓": r"\surd", "✗": r"\times",
         "⊤": r"\top", "ℓ": r"\ell"} | {k: "\\" + v for k, v in _GREEK.items()} | {
    g: rf"\mathrm{{{latin}}}" for g, latin in zip("ΑΒΕΖΗΙΚΜΝΟΡΤΧ", "ABEZHIKMNOPTX", strict=True)}
_SUPER = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ", "0123456789+-=()ni", strict=True)) | {"ᵀ": r"\top"}
_SUB = dict(zip("₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎ₐₑₒₓₕₖₗₘₙₚₛₜᵢⱼ", "0123456789+-=()aeoxhklmnpstij", strict=True))
_SCRIPT = re.compile(f"([{re.escape(''.join(_SUPER))}]+)|([{re.escape(''.join(_SUB))}]+)|(.)", re.S)
_MINUS = re.compile(r"(?<![\w.])-(?=\.?\d)")  # "-2", "(-0.5": not "1e-05", "x-1" or "--"
# Latin-1 letters pdflatex's default input reads as they are, but for these
_NO_LATIN1 = set("ÐÞðþ\u00ad")


def latex_text(text: str, unknown: set[str] | None = None) -> str:
    """``text`` for LaTeX's text mode: specials escaped, Unicode as LaTeX (runs of math pieces
    share one ``$…$``: ``ρ₀`` → ``$\\rho_{0}$``, ``10⁻²`` → ``10$^{-2}$``, a leading ``-2`` →
    ``$-$2``). A character LaTeX
    cannot print without extra packages becomes ``?`` and is added to ``unknown``."""
    out: list[str] = []
    math: list[str] = []

    def flush() -> None:
        if math:
            out.append("$" + "".join(math) + "$")
            math.clear()

    text = _MINUS.sub("−", text)  # a number's sign, typeset as a minus
    for sup, sub, char in _SCRIPT.findall(text):
        if sup or sub:
            math.append(("^{" + "".join(_SUPER[c] for c in sup) if sup else
                         "_{" + "".join(_SUB[c] for c in sub)) + "}")
        elif char in _MATH:
            math.append(_MATH[char])
        else:
            flush()
            if char in _TEXT:
                out.append(_TEXT[char])
            elif char.isascii() or ("\u00a0" <= char <= "\u00ff" and char not in _NO_LATIN1):
                out.append(char)
            else:
                if unknown is not None:
                    unknown.add(char)
                out.append("?")
    flush()
    return "".join(out)


def to_latex(shown: pd.DataFrame, title: str, label: str, keys: int,
             unknown: set[str] | None = None) -> str:
    """The display table as a booktabs LaTeX table (``Styler.to_latex``), every header, cell
    and the caption through :func:`latex_text`; the ``keys`` row-key columns left-aligned,
    the numbers right."""
    from pandas.io.formats.style import Styler

    body = shown.map(lambda v: latex_text(str(v), unknown))
    body.columns = [latex_text(str(c), unknown) for c in shown.columns]
    return Styler(body).hide(axis="index").to_latex(
        column_format="l" * keys + "r" * (len(shown.columns) - keys), hrules=True,
        caption=latex_text(title, unknown), label=label, position_float="centering")


