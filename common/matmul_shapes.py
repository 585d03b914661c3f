"""`--param shapes=MxNxK,MxNxK`: matmul shapes a user names, so a kernel is timed at a size that
matters to them and not only at the lab's N x N x N. Parsed and checked before any work (a bad
value is one line naming it, exit 2), then timed by the matmul exercises beside their `sizes`.

    lab run phase2.matmul --param shapes=4000x5000x6008,13x4096x14336
    lab run phase3.matmul --param shapes=8x14336x4096
"""
import random
import re

from .params import Param

INT32_MAX = 2**31 - 1
_ONE = re.compile(r"^(\d+)[xX](\d+)[xX](\d+)$")
FORMAT = "MxNxK,MxNxK,... (e.g. 4000x5000x6008,13x4096x14336): C = A @ B with A M x K, B K x N"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """[(M, N, K), ...] from "MxNxK,MxNxK"; ValueError saying which part is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected {FORMAT}")
    shapes = []
    for part in text.replace(" ", "").split(","):
        match = _ONE.match(part)
        if not match:
            raise ValueError(f"'{part}' is not MxNxK; expected {FORMAT}")
        m, n, k = (int(g) for g in match.groups())
        if min(m, n, k) < 1:
            raise ValueError(f"'{part}': M, N and K must be at least 1")
        if max(m * k, k * n, m * n) > INT32_MAX:
            raise ValueError(f"'{part}': each matrix must have fewer than 2^31 elements (the kernels index with int)")
        shapes.append((m, n, k))
    return shapes


def _why_not(text) -> str | None:
    try:
        parse_shapes(text)
    except ValueError as e:
        return str(e)
    return None


def Shapes() -> Param:
    """The exercises' `shapes` parameter: null (none) or "MxNxK,MxNxK" text."""
    return Param(None, "str", unit="MxNxK,MxNxK,...", nullable=True, rule=_why_not,
                 help=f"extra shapes to time beside sizes, {FORMAT}")


def shape_text(shapes) -> str:
    """The `--param shapes=` text of [(M, N, K), ...]."""
    return ",".join(f"{m}x{n}x{k}" for m, n, k in shapes)


def irregular_shapes(count: int, seed: int, k_multiple: int = 8) -> list[tuple[int, int, int]]:
    """`count` large products no tile fits: M, N, K drawn from 4000..8191 with a fixed seed, none a
    multiple of 64 (K a multiple of `k_multiple`, the TMA kernels' 16-byte rows)."""
    rng = random.Random(seed)

    def draw(multiple: int) -> int:
        while True:
            v = rng.randrange(4000, 8192)
            v -= v % multiple
            if v >= 4000 and v % 64:
                return v

    return [(draw(1), draw(1), draw(k_multiple)) for _ in range(count)]
