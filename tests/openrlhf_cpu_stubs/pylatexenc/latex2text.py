"""Stand-in."""

from _missing import unavailable


class LatexNodes2Text:
    latex_to_text = unavailable("pylatexenc.latex2text.LatexNodes2Text.latex_to_text")
