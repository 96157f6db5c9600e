"""Small integer helpers shared by the engine (page and window arithmetic lives on top of these)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def align_down(x: int, multiple: int) -> int:
    return x - x % multiple


def align_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple
