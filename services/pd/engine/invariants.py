"""The integrity check shared by the PD policy code (``check_integrity`` methods)."""


def check(condition: bool, message: str) -> None:
    """Raise AssertionError with ``message`` when an invariant is violated."""
    if not condition:
        raise AssertionError(message)
