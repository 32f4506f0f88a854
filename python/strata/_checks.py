"""Argument checks the Python layers share."""

from ._strata import InvalidArgumentError


def check_page_size(page_size) -> None:
    """Raises InvalidArgumentError unless `page_size` is a power of two
    (the runtime checks its range, 4 KiB to 2 MiB)."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0 or page_size & (page_size - 1):
        raise InvalidArgumentError(f"page_size {page_size!r} is not a power of two (4096 to 2 MiB)")
