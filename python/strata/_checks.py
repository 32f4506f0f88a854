"""Argument checks the Python layers share."""

from ._strata import InvalidArgumentError


def check_page_size(page_size, what: str = "page_size") -> None:
    """Raises InvalidArgumentError unless `page_size` is a power of two
    from 4 KiB to 2 MiB (the runtime's range), before anything is sized by it."""
    if (
        not isinstance(page_size, int)
        or isinstance(page_size, bool)
        or not 4096 <= page_size <= 2 << 20
        or page_size & (page_size - 1)
    ):
        raise InvalidArgumentError(f"{what} {page_size!r} is not a power of two from 4 KiB to 2 MiB")


def check_count(value, what: str, least: int = 0) -> None:
    """Raises InvalidArgumentError unless `value` is a whole number (an int,
    not a bool) of at least `least`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidArgumentError(f"{what} {value!r} is not a whole number from {least}")
