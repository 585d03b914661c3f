"""How the READMEs write a value: one function per kind, '-' for a missing value everywhere."""
import math


def missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def num(x, digits: int = 3) -> str:
    """3 significant digits; thousands with separators (999.5 and up, which 'g' would print as 1e+03)."""
    if missing(x):
        return "-"
    x = float(x)
    if x == 0:
        return "0"
    if abs(x) >= 999.5:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def num4(x) -> str:
    return num(x, 4)


def si(x) -> str:
    """A large count with a decimal prefix, 3 significant digits: 30.0M, 1.51M, 12.3k."""
    if missing(x):
        return "-"
    x = float(x)
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:#.3g}".rstrip(".") + prefix
    return num(x)


def pct(x) -> str:
    return "-" if missing(x) else f"{float(x):.1f}%"


def share(x) -> str:
    """A fraction as a percentage: 0.595 -> 59.5%."""
    return "-" if missing(x) else f"{100 * float(x):.1f}%"


def ratio(x) -> str:
    """A factor: 1.23x."""
    return "-" if missing(x) else f"{float(x):.2f}x"


def gib(x) -> str:
    return "-" if missing(x) else f"{float(x):.2f} GiB"


def ms(x) -> str:
    return "-" if missing(x) else f"{num(x)} ms"


def count(x) -> str:
    """A whole number with thousands separators: 881,904."""
    return "-" if missing(x) else f"{int(x):,}"


def size_bytes(n) -> str:
    if missing(n):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024


def elements(n) -> str:
    """A count that is a whole number of Mi or Gi reads as such: 256 Mi."""
    if missing(n):
        return "-"
    n = int(n)
    for unit, scale in (("Gi", 2**30), ("Mi", 2**20)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n:,}"


def text(x) -> str:
    if missing(x):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return x if isinstance(x, str) else num(x)


FINDING_CHARS = 400
"""The longest line a generated README block may hold outside a table: one claim, a sentence or
two with its numbers, about three lines of prose on a laptop screen; a longer line is several
claims run together and reads as a wall (tests/test_report_layer.py holds every README to it)."""


def bullets(claims: list[str], title: str | None = None) -> str:
    """Findings as a list, one claim a bullet, under a bold title (a GPU, a setup) when given;
    empty claims are left out."""
    items = "\n".join(f"- {c}" for c in claims if c)
    return f"**{title}**\n\n{items}" if title and items else items


def markdown(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
